"""DeepSeek sparse attention (DSA) on MLA's latent cache, in Triton: the lightning indexer's scores and top-k,
and attention over each query's selected latent rows.

Cache rows are addressed as the engine's paged pool lays them out: position j of sequence b is row
table[b, j // page] * page + j % page of a [rows, width] tensor (`kv` latents, `k_pe` roped keys and `index_k`
indexer keys each in their own tensor, or side by side in one: only the row stride matters). A contiguous
cache is the special case of one page per sequence (`common.contiguous_table`).

Positions: the queries of sequence b are its last Tq of Tk key positions (query t sits at key position
past + t, past = Tk - Tq), as the model lays out a step; key j is visible to query t when j <= past + t and,
given `key_valid` [B, Tk], both key j and the query's own position are real tokens (padding sees nothing).

- `index_scores`: score(t, j) = sum_h w[t, h] * relu(q[t, h] . k[j]) in fp32 for every visible j, -inf
  elsewhere (w carries the index scale: relu(s * x) = s * relu(x) for s > 0). Each program scores a tile of
  keys for a few queries; the per-head products live only in registers (the PyTorch path materialises
  [queries x heads x keys]).
- `indexer_topk`: those scores a query chunk at a time, then torch.topk on the device: key positions
  [B, Tq, min(topk, Tk)], ascending, -1 where fewer keys are visible.
- `sparse_mla_attention`: per (query, block of heads), an online softmax over the query's selected rows:
  scores = scale * (q_latent . kv + q_rope . k_pe), output sum p * kv (the values are the latents), fp32
  accumulation; a query with nothing selected gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openglm.kernels.common import check_device, contiguous_table, dot_options, next_pow2

SCORE_BUDGET = 256 << 20  # bytes of fp32 indexer scores per query chunk ([B, chunk, Tk])


def _check_table(table: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    if table.dim() != 2 or table.shape[0] != batch:
        raise ValueError(f"{name}: block table must be [{batch}, pages], got {tuple(table.shape)}")
    return table.to(torch.int32).contiguous()


def _rows(t: torch.Tensor, width: int, name: str) -> None:
    if t.dim() < 2 or t.shape[-1] < width or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected rows of >= {width} contiguous channels, got {tuple(t.shape)} "
                         f"with strides {t.stride()}")


def index_scores(index_q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, page: int,
                 n_keys: int, key_valid: torch.Tensor | None = None, first_pos: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer scores [B, Q, n_keys] fp32, -inf where invisible.

    index_q [B, Q, Hi, Di] (Di contiguous), weights [B, Q, Hi] (the index scale included); keys: rows
    [..., Di] (the pool, or a cache view) addressed by table [B, pages] and `page`; n_keys: Tk; key_valid [B, Tk]
    bool or None; first_pos: the key position of query 0 (default Tk - Q: the queries are the last Q positions)."""
    b, nq, hi, di = index_q.shape
    if weights.shape != (b, nq, hi):
        raise ValueError(f"indexer weights {tuple(weights.shape)}, expected {(b, nq, hi)}")
    _rows(keys, di, "index keys")
    table = _check_table(table, b, "index keys")
    device = check_device(index_q, weights, keys, table, key_valid)
    out = torch.empty(b, nq, n_keys, dtype=torch.float32, device=device) if out is None else out
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    w = weights.float().contiguous()
    valid = key_valid.to(torch.uint8).contiguous() if key_valid is not None else out
    config = index_config(hi, di, index_q.dtype if index_q.dtype == keys.dtype else torch.float32)
    first_pos = n_keys - nq if first_pos is None else first_pos
    grid = (triton.cdiv(nq, config["BLOCK_T"]), triton.cdiv(n_keys, config["BLOCK_N"]), b)
    _index_scores_kernel[grid](
        index_q, index_q.stride(0), index_q.stride(1), index_q.stride(2), w, w.stride(0), w.stride(1),
        keys, keys.stride(-2), table, table.stride(0), page, valid, valid.stride(0) if key_valid is not None else 0,
        out, out.stride(0), out.stride(1), nq, n_keys, first_pos, hi, di, HAS_VALID=key_valid is not None, **config)
    return out


def index_config(heads: int, dim: int, dtype: torch.dtype) -> dict:
    """The indexer kernel's compile-time parameters and launch options for products of `dtype` operands:
    ~64 (query, head) rows per dot (BLOCK_T queries of HI_P heads), 64 keys per program. fp32 products use
    Triton's tf32x3 (three TF32 tensor-core products per fp32 product, fp32-level accuracy): exact fp32 ("ieee")
    dots of these tiles spill registers on sm_90 (tests/kernels/test_compile.py)."""
    upcast, precision = dot_options(dtype, fp32="tf32x3")
    hi_p = next_pow2(heads, 1)
    return dict(HI_P=hi_p, DI_P=next_pow2(dim), BLOCK_T=max(1, 64 // hi_p), BLOCK_N=64, UPCAST=upcast,
                PRECISION=precision, num_warps=4, num_stages=2)


def indexer_topk(index_q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, topk: int, *,
                 table: torch.Tensor | None = None, page: int | None = None, n_keys: int | None = None,
                 key_valid: torch.Tensor | None = None, score_dtype: torch.dtype = torch.float32,
                 budget_bytes: int = SCORE_BUDGET) -> torch.Tensor:
    """The indexer's top-k key positions per query, [B, Tq, min(topk, Tk)] int64 ascending, -1 where fewer keys
    are visible (the model's `sparse_dsa.indexer_topk` contract). keys: [B, Tk, Di] (a contiguous cache) without
    `table`, else pool rows addressed by table / page with n_keys = Tk. score_dtype: the q . k products' operand
    dtype (fp32: exact products, as the model's default; bf16: tensor-core products of bf16-rounded operands,
    the model's opt-in `score_dtype`), accumulated in fp32 either way."""
    if score_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"score_dtype={score_dtype}: expected torch.float32 or torch.bfloat16")
    index_q = index_q.to(score_dtype)
    if score_dtype == torch.bfloat16 and keys.dtype != score_dtype:
        keys = keys.to(score_dtype)
    b, tq = index_q.shape[:2]
    if table is None:
        keys, table, page = contiguous_table(keys)
        n_keys = keys.shape[1]
    elif page is None or n_keys is None:
        raise ValueError("a block table needs page and n_keys")
    n_top = min(topk, n_keys)
    if n_keys <= topk:  # every visible key is selected: no scores needed
        return _all_visible(b, tq, n_keys, key_valid, index_q.device)
    chunk = max(1, min(tq, budget_bytes // max(1, 4 * b * n_keys)))
    out = torch.empty(b, tq, n_top, dtype=torch.long, device=index_q.device)
    scores = torch.empty(b, chunk, n_keys, dtype=torch.float32, device=index_q.device)
    for s in range(0, tq, chunk):
        e = min(tq, s + chunk)
        sc = index_scores(index_q[:, s:e], weights[:, s:e], keys, table, page, n_keys, key_valid,
                          first_pos=n_keys - tq + s, out=scores[:, : e - s])
        out[:, s:e] = top_slots(sc, n_top)
    return out


def top_slots(scores: torch.Tensor, n_top: int) -> torch.Tensor:
    """The top n_top positions of each row of scores [..., Tk] (-inf = invisible), as `sparse_dsa.topk_slots`
    picks them: a set (torch.topk, unsorted), ascending, -1 where the score is -inf."""
    vals, idx = scores.topk(n_top, dim=-1, sorted=False)
    return idx.masked_fill_(vals == float("-inf"), -1).sort(-1).values


def _all_visible(b: int, tq: int, n_keys: int, key_valid, device) -> torch.Tensor:
    past = n_keys - tq
    j = torch.arange(n_keys, device=device)
    ok = j[None, :] <= (past + torch.arange(tq, device=device))[:, None]
    ok = ok.expand(b, tq, n_keys)
    if key_valid is not None:
        kv = key_valid.bool()
        ok = ok & kv[:, None, :] & kv[:, past:, None]
    return j.expand(b, tq, n_keys).masked_fill(~ok, -1)


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, slots: torch.Tensor, scale: float, *,
                         table: torch.Tensor | None = None, page: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over its selected latent rows: [B, Tq, H, rank] in q's dtype.

    q [B, Tq, H, rank + rope] (the absorbed query: q_nope W_uk, then the roped part; the last dimension
    contiguous); kv / pe: the latent and roped-key rows, [B, Tk, rank] / [B, Tk, rope] views of a contiguous cache
    (one page per sequence) without `table`, else pool rows [S, >= rank] / [S, >= rope] addressed by
    table [B, pages] and `page`; slots [B, Tq, K] key positions, -1 = unused."""
    b, tq, h, d = q.shape
    rank, rope = kv.shape[-1], pe.shape[-1]
    if d != rank + rope:
        raise ValueError(f"query width {d} != latent {rank} + rope {rope}")
    if slots.dim() != 3 or slots.shape[:2] != (b, tq):
        raise ValueError(f"slots {tuple(slots.shape)}, expected [{b}, {tq}, K]")
    if table is None:
        if kv.shape[:2] != pe.shape[:2] or kv.shape[0] != b:
            raise ValueError(f"kv {tuple(kv.shape)} and k_pe {tuple(pe.shape)} must be [{b}, Tk, ...]")
        kv, table, page = contiguous_table(kv)
        pe, pe_table, pe_page = contiguous_table(pe)
        if pe_page != page:  # laid out differently from kv: copy both to one page size
            kv, pe = kv.reshape(b, -1, rank).contiguous(), pe.reshape(b, -1, rope).contiguous()
            page = pe_page = kv.shape[1]
    elif page is None:
        raise ValueError("a block table needs its page size")
    _rows(kv, rank, "kv")
    _rows(pe, rope, "k_pe")
    table = _check_table(table, b, "kv")
    device = check_device(q, kv, pe, slots, table)
    if q.stride(-1) != 1:
        q = q.contiguous()
    slots = slots.to(torch.int32).contiguous()
    out = torch.empty(b, tq, h, rank, dtype=q.dtype, device=device) if out is None else out
    if b * tq == 0 or h == 0:
        return out
    config = attention_config(rank, rope, q.dtype if q.dtype == kv.dtype else torch.float32)
    _sparse_mla_kernel[(b * tq, triton.cdiv(h, config["BLOCK_H"]))](
        q, q.stride(0), q.stride(1), q.stride(2), kv, pe, kv.stride(-2), pe.stride(-2), table, table.stride(0),
        page, slots, slots.stride(0), slots.stride(1), out, out.stride(0), out.stride(1), out.stride(2),
        tq, h, slots.shape[-1], scale * 1.4426950408889634, **config)  # log2(e): the softmax uses exp2
    return out


def attention_config(rank: int, rope: int, dtype: torch.dtype) -> dict:
    """The attention kernel's compile-time parameters and launch options: 16 heads per program (a decode step of
    32 sequences x 64 heads is then 128 programs), 32 selected rows per step (16 in fp32), 8 warps (at rank 512
    the [16, 512] fp32 accumulator and the row tiles fit without spilling on sm_90: tests/kernels/test_compile.py)."""
    upcast, precision = dot_options(dtype)
    return dict(RANK=rank, ROPE=rope, RANK_P=next_pow2(rank), ROPE_P=next_pow2(rope), BLOCK_H=16,
                BLOCK_K=16 if dtype == torch.float32 else 32, UPCAST=upcast, PRECISION=precision,
                num_warps=8, num_stages=2)


@triton.jit
def _dot_t(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, D] . b [N, D]^T in fp32."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    else:
        out = tl.dot(a, tl.trans(b.to(a.dtype)), input_precision=PRECISION)
    return out


@triton.jit
def _index_scores_kernel(q_ptr, stride_qb, stride_qt, stride_qh, w_ptr, stride_wb, stride_wt,
                         k_ptr, stride_k, table_ptr, stride_table, page, valid_ptr, stride_valid,
                         out_ptr, stride_ob, stride_ot, NQ, N_KEYS, FIRST, HI, DI,
                         HAS_VALID: tl.constexpr, HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_t, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # this program's queries (chunk-relative)
    t_ok = ts < NQ
    qpos = FIRST + ts  # their key positions
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N_KEYS
    scores = tl.full((BLOCK_T, BLOCK_N), float("-inf"), tl.float32)
    last = FIRST + tl.minimum(pid_t * BLOCK_T + BLOCK_T, NQ) - 1
    if pid_n * BLOCK_N <= last:  # a key tile wholly in the future of every query stays -inf, unread
        m = tl.arange(0, BLOCK_T * HI_P)  # (query, head) rows of one dot
        mt = pid_t * BLOCK_T + m // HI_P
        mh = m % HI_P
        m_ok = (mt < NQ) & (mh < HI)
        ds = tl.arange(0, DI_P)
        d_ok = ds < DI
        q = tl.load(q_ptr + b * stride_qb + mt[:, None] * stride_qt + mh[:, None] * stride_qh + ds[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0)
        w = tl.load(w_ptr + b * stride_wb + mt * stride_wt + mh, mask=m_ok, other=0.0)
        ns_safe = tl.where(n_ok, ns, 0)
        pg = tl.load(table_ptr + b * stride_table + ns_safe // page, mask=n_ok, other=0)
        rows = pg.to(tl.int64) * page + ns_safe % page
        k = tl.load(k_ptr + rows[:, None] * stride_k + ds[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0)
        s = _dot_t(q, k, UPCAST, PRECISION)  # [BLOCK_T * HI_P, BLOCK_N]
        s = tl.maximum(s, 0.0) * w[:, None]
        summed = tl.sum(tl.reshape(s, (BLOCK_T, HI_P, BLOCK_N)), axis=1)
        visible = (ns[None, :] <= qpos[:, None]) & n_ok[None, :] & t_ok[:, None]
        if HAS_VALID:
            k_real = tl.load(valid_ptr + b * stride_valid + ns, mask=n_ok, other=0) != 0
            q_real = tl.load(valid_ptr + b * stride_valid + qpos, mask=t_ok, other=0) != 0
            visible = visible & k_real[None, :] & q_real[:, None]
        scores = tl.where(visible, summed, float("-inf"))
    tl.store(out_ptr + b * stride_ob + ts[:, None] * stride_ot + ns[None, :], scores,
             mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _sparse_mla_kernel(q_ptr, stride_qb, stride_qt, stride_qh, kv_ptr, pe_ptr, stride_kv, stride_pe,
                       table_ptr, stride_table, page, slot_ptr, stride_sb, stride_st,
                       o_ptr, stride_ob, stride_ot, stride_oh, T, H, K, scale_log2,
                       RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P: tl.constexpr, ROPE_P: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    r = tl.program_id(0)
    b, t = (r // T).to(tl.int64), (r % T).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < H
    cr = tl.arange(0, RANK_P)
    cr_ok = cr < RANK
    cp = tl.arange(0, ROPE_P)
    cp_ok = cp < ROPE
    q_row = q_ptr + b * stride_qb + t * stride_qt + hs[:, None] * stride_qh
    q_lat = tl.load(q_row + cr[None, :], mask=h_ok[:, None] & cr_ok[None, :], other=0)
    q_pe = tl.load(q_row + RANK + cp[None, :], mask=h_ok[:, None] & cp_ok[None, :], other=0)
    m_i = tl.full((BLOCK_H,), -1.0e30, tl.float32)  # finite: a row with nothing selected yet stays NaN-free
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK_P), tl.float32)
    slot_row = slot_ptr + b * stride_sb + t * stride_st
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        j = tl.load(slot_row + ks, mask=ks < K, other=-1)
        ok = j >= 0
        j = tl.where(ok, j, 0)
        pg = tl.load(table_ptr + b * stride_table + j // page, mask=ok, other=0)
        rows = pg.to(tl.int64) * page + j % page
        kv = tl.load(kv_ptr + rows[:, None] * stride_kv + cr[None, :], mask=ok[:, None] & cr_ok[None, :], other=0)
        kp = tl.load(pe_ptr + rows[:, None] * stride_pe + cp[None, :], mask=ok[:, None] & cp_ok[None, :], other=0)
        s = (_dot_t(q_lat, kv, UPCAST, PRECISION) + _dot_t(q_pe, kp, UPCAST, PRECISION)) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = tl.dot(p, kv.to(tl.float32))
        else:
            pv = tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_row = o_ptr + b * stride_ob + t * stride_ot + hs[:, None] * stride_oh + cr[None, :]
    tl.store(o_row, o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & cr_ok[None, :])
