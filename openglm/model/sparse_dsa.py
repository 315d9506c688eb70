"""DeepSeek sparse attention (DSA) by gathering: each query reads only its top-k keys.

The lightning indexer scores every earlier key for each query (quadratic by design, but a few small heads),
one query block at a time so its memory is O(block x N); attention then gathers the k selected cache entries
per query, so attention memory and FLOPs are O(N x k) instead of the dense-mask formulation's O(N^2).
For MLA, pass the absorbed form (`sparse.mla_absorbed`): the gathered entries are the small latents.
"""
from __future__ import annotations

import torch

from openglm.model.sparse import DEFAULT_BUDGET, check_qkv, needs_grad
from openglm.model.sparse_patterns import SparsePattern, allowed, key_positions

_CAUSAL = SparsePattern("dense")


def _block(bytes_per_query: int, n_queries: int, budget_bytes: int) -> int:
    block = 1
    while block < n_queries and 2 * block * bytes_per_query <= budget_bytes:
        block *= 2
    return min(block, n_queries)


def indexer_topk(index_q, index_k, weights, topk: int, *, scale: float | None = None,
                 key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET) -> torch.Tensor:
    """Top-k key slots per query, [B, Tq, min(topk, Tk)] int64, -1 where fewer keys are visible.

    index_q [B, Tq, Hi, Di], index_k [B, Tk, Di], weights [B, Tq, Hi] (already scaled as the model wants).
    score(i, j) = sum_h weights[i, h] * relu(scale * index_q[i, h] . index_k[j]) over causal, non-padding j,
    as in transformers' GlmMoeDsaIndexer."""
    b, tq, hi, di = index_q.shape
    tk = index_k.shape[1]
    if index_k.shape != (b, tk, di) or weights.shape != (b, tq, hi):
        raise ValueError(f"indexer shapes: q {tuple(index_q.shape)}, k {tuple(index_k.shape)}, "
                         f"weights {tuple(weights.shape)}")
    scale = di ** -0.5 if scale is None else scale
    kpos, valid = key_positions(key_mask, key_pos, b, tk, device=index_q.device)
    n_top = min(topk, tk)
    out = torch.full((b, tq, n_top), -1, dtype=torch.long, device=index_q.device)
    block = _block(4 * (hi + 2) * tk, tq, budget_bytes)
    past = tk - tq
    for s in range(0, tq, block):
        e = min(tq, s + block)
        qe = past + e  # causal: no key after the block's last query is ever visible
        q = index_q[:, s:e].reshape(b, (e - s) * hi, di).float()
        sc = torch.matmul(q, index_k[:, :qe].transpose(1, 2).float()).mul_(scale).relu_()
        sc = torch.matmul(weights[:, s:e].float().unsqueeze(2), sc.view(b, e - s, hi, qe)).squeeze(2)
        ok = allowed(_CAUSAL, kpos[:, past + s:qe], valid[:, past + s:qe], kpos[:, :qe], valid[:, :qe])
        sc.masked_fill_(~ok, float("-inf"))
        vals, idx = sc.topk(min(n_top, qe), dim=-1, sorted=False)  # order is irrelevant: a set
        out[:, s:e, :idx.shape[-1]] = torch.where(vals > float("-inf"), idx, torch.full_like(idx, -1))
    return out


def gather_attention(q, k, v, topk_idx, *, scale: float | None = None,
                     budget_bytes: int = DEFAULT_BUDGET) -> torch.Tensor:
    """Attention of each query over its own key slots topk_idx [B, Tq, K] (-1 = unused); [B, H, Tq, Dv].

    Per query block, the selected rows of k and v are gathered into two reused buffers (fresh large
    allocations are slow), then scored per query: O(Tq x K) memory and FLOPs."""
    check_qkv(q, k, v)
    b, h, tq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = h // hkv
    if topk_idx.shape[:2] != (b, tq):
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({b}, {tq}, K)")
    n_top = topk_idx.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    out = q.new_empty(b, h, tq, dv)
    block = _block(4 * n_top * (hkv * (dk + dv) + 2 * h), tq, budget_bytes)
    grad = needs_grad(q, k, v)
    kbuf = None if grad else k.new_empty(hkv, block * n_top, dk)
    vbuf = None if grad else v.new_empty(hkv, block * n_top, dv)
    for s in range(0, tq, block):
        e = min(tq, s + block)
        n = (e - s) * n_top
        ix = topk_idx[:, s:e].long()
        ix = ix.sort(-1).values  # ascending slots: friendlier memory access; -1s come first
        ok = ix >= 0  # [B, Q, K]
        ix = ix.clamp(min=0)
        for i in range(b):
            flat = ix[i].reshape(-1)
            kg = torch.index_select(k[i], 1, flat, out=None if grad else kbuf[:, :n]).view(hkv, e - s, n_top, dk)
            vg = torch.index_select(v[i], 1, flat, out=None if grad else vbuf[:, :n]).view(hkv, e - s, n_top, dv)
            qg = q[i, :, s:e].reshape(hkv, g, e - s, dk).transpose(1, 2)  # [Hkv, Q, G, Dk]
            sc = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)  # [Hkv, Q, G, K]
            sc.masked_fill_(~ok[i, None, :, None, :], float("-inf"))
            p = torch.softmax(sc, -1) if grad else torch.softmax(sc, -1, out=sc)
            o = torch.matmul(p, vg)  # [Hkv, Q, G, Dv]
            out[i, :, s:e] = o.transpose(1, 2).reshape(h, e - s, dv)
    return out.masked_fill_(~(topk_idx >= 0).any(-1)[:, None, :, None], 0.0)


def dsa_attention(q, k, v, index_q, index_k, weights, topk: int, *, scale=None, index_scale=None,
                  key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET) -> torch.Tensor:
    """Indexer top-k then gather attention, fused per query block so the top-k indices never exist for the
    whole sequence at once (they alone would be Tq x k x 8 bytes: 1 GiB at 64K x 2048). [B, H, Tq, Dv]."""
    check_qkv(q, k, v)
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    past = tk - tq
    block = max(1, budget_bytes // (16 * b * min(topk, tk)))
    out = q.new_empty(b, h, tq, v.shape[-1])
    for s in range(0, tq, block):
        e = min(tq, s + block)
        qe = past + e  # the block only ever sees keys up to its last query
        mask = None if key_mask is None else key_mask[:, :qe]
        pos = None if key_pos is None else key_pos[:, :qe]
        idx = indexer_topk(index_q[:, s:e], index_k[:, :qe], weights[:, s:e], topk, scale=index_scale,
                           key_mask=mask, key_pos=pos, budget_bytes=budget_bytes)
        out[:, :, s:e] = gather_attention(q[:, :, s:e], k[:, :, :qe], v[:, :, :qe], idx, scale=scale,
                                          budget_bytes=budget_bytes)
    return out
