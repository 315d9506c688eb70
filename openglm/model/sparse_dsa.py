"""DeepSeek sparse attention (DSA) by gathering: each query reads only its top-k keys.

The lightning indexer scores every earlier key for each query (quadratic by design, but a few small heads),
one query block at a time so its memory is O(block x N); attention then reads only the k selected cache
entries per query, so attention memory and FLOPs are O(N x k) instead of the dense-mask formulation's O(N^2).
For MLA, pass the absorbed form (`sparse.mla_absorbed`): the gathered entries are the small latents.

Inference reads the selected rows in place instead of copying them: the scores q . k_j of the selected
(query, key) pairs are one sampled matrix product (`torch.sparse.sampled_addmm` over a CSR pattern), and the
weighted sum of the selected values is `F.embedding_bag` with per-sample weights. Both stay fp32, so the
result equals the dense-mask formulation. `score_dtype=torch.bfloat16` runs the indexer's matmul in bf16
(the real DSA indexer runs in FP8); that may change which keys win near-ties, so it is an opt-in.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from openglm.model.sparse import DEFAULT_BUDGET, check_qkv, needs_grad
from openglm.model.sparse_patterns import SparsePattern, allowed, key_positions

_CAUSAL = SparsePattern("dense")
SCORE_DTYPES = (torch.float32, torch.bfloat16)


def _block(bytes_per_query: int, n_queries: int, budget_bytes: int) -> int:
    block = 1
    while block < n_queries and 2 * block * bytes_per_query <= budget_bytes:
        block *= 2
    return min(block, n_queries)


def _check_indexer(index_q, index_k, weights, score_dtype):
    b, tq, hi, di = index_q.shape
    tk = index_k.shape[1]
    if index_k.shape != (b, tk, di) or weights.shape != (b, tq, hi):
        raise ValueError(f"indexer shapes: q {tuple(index_q.shape)}, k {tuple(index_k.shape)}, "
                         f"weights {tuple(weights.shape)}")
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype={score_dtype}: expected one of {SCORE_DTYPES}")


def _check_scale(scale: float) -> float:
    if not scale > 0:  # index_scores applies it after the relu, which only a positive scale commutes with
        raise ValueError(f"indexer scale must be positive, got {scale}")
    return scale


def index_scores(index_q, index_k_t, weights, scale: float, score_dtype=torch.float32):
    """Indexer scores [B, Q, Tk] fp32 of one query block: sum_h w[h] * relu(scale * q[h] . k).

    index_q [B, Q, Hi, Di], index_k_t [B, Di, Tk] (already in score_dtype), weights [B, Q, Hi]."""
    b, nq, hi, di = index_q.shape
    q = index_q.reshape(b, nq * hi, di).to(score_dtype)
    sc = torch.bmm(q, index_k_t).relu_()  # one [Q*Hi, Di] x [Di, Tk] product per sequence; scale after relu
    sc = sc.view(b, nq, hi, -1)
    w = weights.to(score_dtype).unsqueeze(2) * scale  # relu(scale * x) = scale * relu(x): scale > 0
    return torch.matmul(w, sc).squeeze(2).float()


def _causal_ok(kpos, valid, qs: int, qe: int):
    """bool [B, qe - qs, qe]: which of the first qe slots each query slot in [qs, qe) may see."""
    return allowed(_CAUSAL, kpos[:, qs:qe], valid[:, qs:qe], kpos[:, :qe], valid[:, :qe])


PREFILTER_STRIDE = 16  # the threshold sample reads every 16th score of a row
PREFILTER_SLACK = 1.5  # ... and keeps 1.5x its share of the top-k, so the threshold rarely overshoots


def _top_slots(sc, n_top: int):
    """Top n_top slots per row of masked scores [B, Q, Tk] as [B, Q, n_top] long (-1 where -inf), each row
    in ascending slot order (cache-friendly reads; the attention needs no sort).

    Long rows are prefiltered: a threshold from a strided sample of the row keeps a few times k candidates,
    and the exact top-k runs on those only (torch.topk costs ~10 ns per element here). A row whose candidates
    are fewer than k (the sample overshot) falls back to the full row, so the set is always the exact top-k."""
    b, nq, tk = sc.shape
    n_top = min(n_top, tk)
    rows = sc.reshape(b * nq, tk)
    n_sample = int(PREFILTER_SLACK * n_top / PREFILTER_STRIDE)
    if n_sample < 1 or tk < 4 * PREFILTER_STRIDE * n_sample:
        return _plain_top(rows, n_top).view(b, nq, n_top)
    thr = rows[:, ::PREFILTER_STRIDE].topk(n_sample, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    keep = rows >= thr
    count = keep.sum(-1)
    short = (count < n_top) | (thr.squeeze(-1) == float("-inf"))
    keep[short] = False
    out = torch.empty(b * nq, n_top, dtype=torch.long, device=sc.device)
    if not bool(short.all()):
        out[~short] = _compact_top(rows, keep, count.masked_fill(short, 0), n_top)[~short]
    if bool(short.any()):
        out[short] = _plain_top(rows[short], n_top)
    return out.view(b, nq, n_top)


def _plain_top(rows, n_top: int):
    vals, idx = rows.topk(n_top, dim=-1, sorted=False)  # a set: sorted by slot below, not by score
    return idx.masked_fill_(vals == float("-inf"), -1).sort(-1).values


def _compact_top(rows, keep, count, n_top: int):
    """Exact top n_top among each row's kept entries (rows with fewer kept entries give junk; callers skip)."""
    r, c = keep.nonzero(as_tuple=True)  # row-major: each row's candidates are contiguous
    pos = torch.arange(r.numel(), device=rows.device) - (count.cumsum(0) - count)[r]
    width = max(n_top, int(count.max()))
    vals = rows.new_full((rows.shape[0], width), float("-inf"))
    cols = torch.full((rows.shape[0], width), -1, dtype=torch.long, device=rows.device)
    vals[r, pos], cols[r, pos] = rows[r, c], c
    top_vals, top = vals.topk(n_top, dim=-1, sorted=False)
    sel = vals >= top_vals.amin(-1, keepdim=True)  # candidates are in slot order: keep that order
    if bool((sel.sum(-1) == n_top).all()):  # no ties at the k-th score: the selection is the top-k set
        return cols[sel].view(-1, n_top)
    return cols.gather(1, top).masked_fill_(top_vals == float("-inf"), -1).sort(-1).values


def indexer_topk(index_q, index_k, weights, topk: int, *, scale: float | None = None,
                 key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET,
                 score_dtype=torch.float32) -> torch.Tensor:
    """Top-k key slots per query, [B, Tq, min(topk, Tk)] int64, -1 where fewer keys are visible.

    index_q [B, Tq, Hi, Di], index_k [B, Tk, Di], weights [B, Tq, Hi] (already scaled as the model wants).
    score(i, j) = sum_h weights[i, h] * relu(scale * index_q[i, h] . index_k[j]) over causal, non-padding j,
    as in transformers' GlmMoeDsaIndexer."""
    _check_indexer(index_q, index_k, weights, score_dtype)
    b, tq, hi, di = index_q.shape
    tk = index_k.shape[1]
    scale = _check_scale(di ** -0.5 if scale is None else scale)
    kpos, valid = key_positions(key_mask, key_pos, b, tk, device=index_q.device)
    n_top = min(topk, tk)
    out = torch.full((b, tq, n_top), -1, dtype=torch.long, device=index_q.device)
    block = _block(4 * (hi + 2) * tk, tq, budget_bytes)
    past = tk - tq
    kt = index_k.transpose(1, 2).to(score_dtype)
    for s in range(0, tq, block):
        e = min(tq, s + block)
        qe = past + e  # causal: no key after the block's last query is ever visible
        sc = index_scores(index_q[:, s:e], kt[:, :, :qe], weights[:, s:e], scale, score_dtype)
        sc.masked_fill_(~_causal_ok(kpos, valid, past + s, qe), float("-inf"))
        idx = _top_slots(sc, n_top)
        out[:, s:e, :idx.shape[-1]] = idx
    return out


def gather_attention(q, k, v, topk_idx, *, scale: float | None = None,
                     budget_bytes: int = DEFAULT_BUDGET, sorted_slots: bool = False) -> torch.Tensor:
    """Attention of each query over its own key slots topk_idx [B, Tq, K] (-1 = unused); [B, H, Tq, Dv].

    sorted_slots: the caller promises each row's slots ascend (-1s anywhere), which saves a sort.

    O(Tq x K) memory and FLOPs. Inference reads the selected rows in place (`_sparse_attend`; fp32 q and k,
    v fp32 or bf16: the value sum then runs in bf16); with autograd the rows are gathered per query block and
    scored with differentiable matmuls."""
    check_qkv(q, k, v)
    b, h, tq, dk = q.shape
    tk = k.shape[2]
    if topk_idx.shape[:2] != (b, tq):
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({b}, {tq}, K)")
    scale = dk ** -0.5 if scale is None else scale
    # A CSR row cannot hold more entries than the matrix has columns (padding entries repeat slot 0).
    if needs_grad(q, k, v) or q.dtype != torch.float32 or k.dtype != torch.float32 or topk_idx.shape[-1] > tk:
        out = _gathered_attend(q, k, v.to(q.dtype), topk_idx, scale, budget_bytes)
    else:
        out = q.new_empty(b, h, tq, v.shape[-1])
        n_top = max(1, topk_idx.shape[-1])
        # per query: slots and mask (int64 + bool), CSR pattern, scores and weights of one head at a time
        block = _block(4 * n_top * 12, tq, budget_bytes)
        for s in range(0, tq, block):
            e = min(tq, s + block)
            idx = topk_idx[:, s:e].long()
            ok = idx >= 0
            for i in range(b):
                out[i, :, s:e] = _sparse_attend(q[i, :, s:e], k[i], v[i], idx[i], ok[i], scale, sorted_slots)
    return out.masked_fill(~(topk_idx >= 0).any(-1)[:, None, :, None], 0.0)


def _sparse_attend(q, k, v, idx, ok, scale: float, sorted_slots: bool = False):
    """One sequence: q [H, Q, Dk], k [Hkv, Tk, Dk], v [Hkv, Tk, Dv], idx/ok [Q, K] -> [H, Q, Dv].

    Rows are read in slot order (cache-friendly); unused entries read slot 0 with weight 0. Queries with no visible key come out NaN; the caller zeroes them."""
    h, nq, _ = q.shape
    hkv, tk = k.shape[:2]
    n_top = idx.shape[-1]
    idx = idx.masked_fill(~ok, 0)
    if not sorted_slots:
        idx, order = idx.sort(-1)
        ok = ok.gather(-1, order)
    cols = idx.reshape(-1)
    crow = torch.arange(0, nq * n_top + 1, n_top, device=q.device)
    offsets = crow[:-1]
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the two ops used here are stable
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(crow, cols, q.new_zeros(nq * n_top), size=(nq, tk))
    out = q.new_empty(h, nq, v.shape[-1])
    g = h // hkv
    for j in range(h):
        kh, vh = k[j // g], v[j // g]
        sc = torch.sparse.sampled_addmm(pattern, q[j], kh.transpose(0, 1), beta=0.0, alpha=scale).values()
        p = torch.softmax(sc.view(nq, n_top).masked_fill_(~ok, float("-inf")), -1)
        out[j] = F.embedding_bag(cols, vh, offsets, mode="sum", per_sample_weights=p.view(-1).to(vh.dtype))
    return out


def _gathered_attend(q, k, v, topk_idx, scale: float, budget_bytes: int):
    """Differentiable path: gather each query block's k / v rows, then matmul + softmax + matmul."""
    b, h, tq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = h // hkv
    n_top = topk_idx.shape[-1]
    block = _block(4 * n_top * (hkv * (dk + dv) + 2 * h), tq, budget_bytes)
    rows = []
    for s in range(0, tq, block):
        e = min(tq, s + block)
        ix = topk_idx[:, s:e].long()
        ok = ix >= 0  # [B, Q, K]
        ix = ix.clamp(min=0)
        per_seq = []
        for i in range(b):
            flat = ix[i].reshape(-1)
            kg = k[i].index_select(1, flat).view(hkv, e - s, n_top, dk)
            vg = v[i].index_select(1, flat).view(hkv, e - s, n_top, dv)
            qg = q[i, :, s:e].reshape(hkv, g, e - s, dk).transpose(1, 2)  # [Hkv, Q, G, Dk]
            sc = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [Hkv, Q, G, K]
            sc = sc.masked_fill(~ok[i, None, :, None, :], float("-inf"))
            o = torch.matmul(torch.softmax(sc, -1), vg)  # [Hkv, Q, G, Dv]
            per_seq.append(o.transpose(1, 2).reshape(h, e - s, dv))
        rows.append(torch.stack(per_seq))
    return torch.cat(rows, 2)


def dsa_attention(q, k, v, index_q, index_k, weights, topk: int, *, scale=None, index_scale=None,
                  key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET,
                  score_dtype=torch.float32, value_dtype=torch.float32) -> torch.Tensor:
    """Indexer top-k then attention over the selected keys, fused per query block: a block's indexer scores
    ([B, block, Hi, Tk]) exist only while it is processed, and the top-k slots only for the current chunk of
    a few blocks, so memory is O(block x N + chunk x k) (the top-k slots of the whole sequence alone would be
    Tq x k x 8 bytes: 1 GiB at 64K x 2048).
    Blocks whose queries see at most `topk` keys skip the indexer: every visible key is selected. [B,H,Tq,Dv].
    score_dtype / value_dtype = torch.bfloat16: indexer matmul / weighted value sum in bf16 (opt-in speed;
    the defaults keep the result equal to the dense-mask formulation within fp32 rounding)."""
    check_qkv(q, k, v)
    _check_indexer(index_q, index_k, weights, score_dtype)
    if value_dtype not in SCORE_DTYPES:
        raise ValueError(f"value_dtype={value_dtype}: expected one of {SCORE_DTYPES}")
    b, h, tq, _ = q.shape
    tk, hi, di = k.shape[2], index_q.shape[2], index_q.shape[3]
    index_scale = _check_scale(di ** -0.5 if index_scale is None else index_scale)
    kpos, valid = key_positions(key_mask, key_pos, b, tk, device=q.device)
    past, n_top = tk - tq, min(topk, tk)
    block = _block(4 * (hi + 2) * tk, tq, budget_bytes)
    # Attention runs on chunks of several indexer blocks: each head's keys are then reused by the whole chunk
    # while they are in cache (~30% faster at 64K); the chunk's slots cost chunk x k x 8 bytes.
    chunk = max(block, _block(4 * n_top * 12, tq, budget_bytes) // block * block)
    kt = index_k.transpose(1, 2).to(score_dtype)
    out = q.new_empty(b, h, tq, v.shape[-1])
    v = v if needs_grad(q, k, v) else v.to(value_dtype)  # one O(N) cast, not one per block
    for c in range(0, tq, chunk):
        ce = min(tq, c + chunk)
        qe = past + ce  # the chunk only ever sees keys up to its last query
        idx = torch.full((b, ce - c, min(n_top, qe)), -1, dtype=torch.long, device=q.device)
        for s in range(c, ce, block):
            e = min(ce, s + block)
            sel = _select(index_q[:, s:e], kt, weights[:, s:e], kpos, valid, past + s, past + e, n_top,
                          index_scale, score_dtype)
            idx[:, s - c:e - c, :sel.shape[-1]] = sel
        out[:, :, c:ce] = gather_attention(q[:, :, c:ce], k[:, :, :qe], v[:, :, :qe], idx, scale=scale,
                                           budget_bytes=budget_bytes, sorted_slots=True)
    return out


def _select(index_q, kt, weights, kpos, valid, qs: int, qe: int, n_top: int, scale: float, score_dtype):
    """Key slots [B, qe - qs, <= n_top] of the query slots [qs, qe), ascending per row, -1 = none."""
    ok = _causal_ok(kpos, valid, qs, qe)
    if qe <= n_top:  # every visible key fits: no scoring, no top-k
        return torch.arange(qe, device=kt.device).expand(ok.shape).masked_fill(~ok, -1)
    sc = index_scores(index_q, kt[:, :, :qe], weights, scale, score_dtype)
    return _top_slots(sc.masked_fill_(~ok, float("-inf")), n_top)
