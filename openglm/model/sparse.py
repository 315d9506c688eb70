"""Attention without an N x N matrix: chunked dense, sliding window and local+global+random kernels.

Layout (as `torch.nn.functional.scaled_dot_product_attention`): q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk],
v [B, Hkv, Tk, Dv], with H a multiple of Hkv (multi-head, GQA, or MQA). The queries are the last Tq of the
Tk cache slots, so the same call serves a full forward, a chunked prefill and a decode step.

MLA uses these kernels in its absorbed form, as MQA over the cache entries (Hkv = 1):
q = [q_nope @ W_uk, q_pe] per head, k = [kv_latent, k_pe], v = kv_latent; see `mla_absorbed`.

Queries are processed in blocks sized so the block's scores stay within `budget_bytes`; each block reads only
its candidate keys (a contiguous local slice plus gathered global/random slots), so memory is
O(block x keys-per-query) and a decode step costs O(window + N / global_stride + n_random), not O(N).
DeepSeek sparse attention (top-k gather) lives in `sparse_dsa.py`.
"""
from __future__ import annotations

import torch

from openglm.model.sparse_patterns import SparsePattern, allowed, candidates, key_positions, plain_bias

DEFAULT_BUDGET = 64 << 20  # bytes of scores per query block; small blocks also avoid slow fresh mmaps
SPARSE_PATTERN_KINDS = ("local_global_random", "sliding_window")  # the model routes these layers here


def check_qkv(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, h, tq, dk), (bk, hkv, tk, dk2) = q.shape, k.shape
    if bk != b or v.shape[0] != b or dk2 != dk or v.shape[1] != hkv or v.shape[2] != tk:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if tq > tk:
        raise ValueError(f"more queries ({tq}) than cached keys ({tk}): the queries are the last Tq slots")


def keys_per_block(pattern: SparsePattern, n_keys: int, block: int) -> int:
    """Upper bound on the candidate keys of one query block (sizes the blocks)."""
    if pattern.kind == "dense":
        return n_keys
    local = min(n_keys, pattern.window + block)
    if pattern.kind == "sliding_window":
        return local
    return local + n_keys // pattern.global_stride + pattern.n_random * (block // pattern.random_block + 2)


def query_block(pattern: SparsePattern, n_heads: int, n_queries: int, n_keys: int, budget_bytes: int) -> int:
    """Power-of-two query block: its scores and probabilities fit the budget, and for windowed kinds it stays
    near window / 4 so the shared local slice (window + block keys) wastes little work."""
    cap = n_queries if pattern.kind == "dense" else max(16, pattern.window // 4)
    block = 1
    while block < min(n_queries, cap):
        if 2 * 4 * n_heads * (2 * block) * keys_per_block(pattern, n_keys, 2 * block) > budget_bytes:
            break
        block *= 2
    return min(block, n_queries)


def attend(q, k, v, bias, scale, row_ok=None):
    """Softmax attention of q [B, H, Q, Dk] over k [B, Hkv, K, Dk], v [B, Hkv, K, Dv].

    bias [B or 1, Q, K] is the additive mask (0 or -inf), fused into the score matmul (baddbmm). row_ok [B, Q]
    marks queries with at least one visible key; the others (padding) return zeros instead of NaN."""
    b, h, nq, dk = q.shape
    hkv = k.shape[1]
    g = h // hkv
    grad = needs_grad(q, k, v)
    out = [] if grad else q.new_empty(b, h, nq, v.shape[-1])
    for i in range(b):
        bi = bias[i if bias.shape[0] > 1 else 0]
        bi = bi if g == 1 else bi.repeat(g, 1)  # rows are (group, query)
        s = torch.baddbmm(bi.unsqueeze(0), q[i].reshape(hkv, g * nq, dk), k[i].transpose(-1, -2), alpha=scale)
        if grad:  # autograd: no out= / in-place variants
            out.append(torch.bmm(torch.softmax(s, -1), v[i]).view(h, nq, -1))
        else:  # inference: reuse buffers (fresh large allocations are slow)
            torch.softmax(s, -1, out=s)
            torch.bmm(s, v[i], out=out[i].view(hkv, g * nq, -1))
    out = torch.stack(out) if grad else out
    return out if row_ok is None else out.masked_fill(~row_ok[:, None, :, None], 0.0)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def mask_to_bias(ok):
    """bool [B, Q, K] -> (additive bias, row_ok); rows with nothing visible get a finite bias (zeroed later)."""
    row_ok = ok.any(-1)
    bias = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, float("-inf"))
    return bias.masked_fill_(~row_ok.unsqueeze(-1), 0.0), row_ok


def take_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, T, D] gathered at slots [B, K] (entries < 0 read slot 0; callers mask them)."""
    idx = slots.clamp(min=0)
    if x.shape[0] == 1:
        return x.index_select(2, idx[0])
    return torch.stack([x[i].index_select(1, idx[i]) for i in range(x.shape[0])])


def attention(q, k, v, pattern: SparsePattern | None = None, *, scale: float | None = None,
              key_mask: torch.Tensor | None = None, key_pos: torch.Tensor | None = None,
              budget_bytes: int = DEFAULT_BUDGET, query_chunk: int | None = None) -> torch.Tensor:
    """Pattern attention; returns [B, H, Tq, Dv].

    key_mask [B, Tk]: 1 = real token, 0 = padding (left or right). key_pos [B, Tk]: token positions
    (default: count of real tokens before each slot). The pattern is defined on positions, so a padded batch
    row gets exactly what the unpadded sequence would. query_chunk overrides the budget's block size."""
    check_qkv(q, k, v)
    pattern = pattern or SparsePattern()
    b, h, tq, dk = q.shape
    tk = k.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    kpos, valid = key_positions(key_mask, key_pos, b, tk, device=q.device)
    plain = key_mask is None and key_pos is None and q.device.type == "cpu"  # position == slot: cached masks
    block = query_chunk or query_block(pattern, h, tq, tk, budget_bytes)
    out = q.new_empty(b, h, tq, v.shape[-1])
    past, cache = tk - tq, {}
    for s in range(0, tq, block):
        e = min(tq, s + block)
        qs, qe = past + s, past + e
        cand = candidates(pattern, kpos, valid, qs, qe)
        lo, hi = cand.lo, cand.hi
        kc, vc = k[:, :, lo:hi], v[:, :, lo:hi]  # the local slice: a view, no copy
        if cand.slots is not None and cand.slots.shape[1]:
            kc = torch.cat([kc, take_slots(k, cand.slots)], 2)
            vc = torch.cat([vc, take_slots(v, cand.slots)], 2)
        if plain:
            bias, row_ok = plain_bias(pattern, qs, qe, cand, cache).to(q.dtype), None
        else:
            bias, row_ok = mask_to_bias(block_mask(pattern, kpos, valid, qs, qe, cand))
            bias = bias.to(q.dtype)
        out[:, :, s:e] = attend(q[:, :, s:e], kc, vc, bias, scale, row_ok)
    return out


def block_mask(pattern, kpos, valid, qs, qe, cand):
    """Exact visibility [B, Q, K] of a query block over its candidates (local slice, then gathered slots)."""
    qpos, q_valid = kpos[:, qs:qe], valid[:, qs:qe]
    ok = allowed(pattern, qpos, q_valid, kpos[:, cand.lo:cand.hi], valid[:, cand.lo:cand.hi])
    if cand.slots is None or cand.slots.shape[1] == 0:
        return ok
    idx = cand.slots.clamp(min=0)
    far = allowed(pattern, qpos, q_valid, kpos.gather(1, idx), valid.gather(1, idx) & (cand.slots >= 0), cand.tags)
    return torch.cat([ok, far], -1)


def mla_absorbed(q_nope, q_pe, w_uk, kv_latent, k_pe):
    """MLA as MQA over the compressed cache, so every sparse kernel can read gathered latents directly.

    q_nope [B, H, T, Dn], q_pe [B, H, T, Dr], w_uk [H, Dn, R] (the key half of kv_b_proj),
    kv_latent [B, Tk, R], k_pe [B, Tk, Dr]. Returns (q [B,H,T,R+Dr], k [B,1,Tk,R+Dr], v [B,1,Tk,R]);
    the attention output [B, H, T, R] is then mapped to values by the value half of kv_b_proj."""
    q_lat = torch.matmul(q_nope, w_uk.unsqueeze(0))  # [B, H, T, R]
    q = torch.cat([q_lat, q_pe], dim=-1)
    k = torch.cat([kv_latent, k_pe], dim=-1).unsqueeze(1)
    return q, k, kv_latent.unsqueeze(1)


def pattern_from_config(cfg, kind: str) -> SparsePattern:
    """The SparsePattern of one layer from ModelConfig's fields (attention_kinds[i], sliding_window, lgr_*)."""
    if kind == "sliding_window":
        return SparsePattern.sliding(cfg.sliding_window)
    if kind == "local_global_random":
        # Queries share random keys per global-stride block (64 by default), so they are gathered once.
        return SparsePattern.lgr(cfg.lgr_local_window, cfg.lgr_global_stride, cfg.lgr_random, cfg.lgr_seed,
                                 random_block=cfg.lgr_global_stride)
    if kind == "dense":
        return SparsePattern("dense")
    raise ValueError(f"attention kind {kind!r} has no SparsePattern (DSA selects keys with its indexer)")


def mla_pattern_attention(q, keys, v_dim: int, pattern: SparsePattern, scale: float, key_valid=None,
                          query_chunk: int | None = None) -> torch.Tensor:
    """The model's layout: q [B, T, H, D], keys [B, N, 1, D] (MLA latent + rope key; values are
    keys[..., :v_dim]), key_valid [B, N] bool or None. Returns [B, T, H, v_dim]."""
    k = keys.transpose(1, 2)
    out = attention(q.transpose(1, 2), k, k[..., :v_dim], pattern, scale=scale, key_mask=key_valid,
                    query_chunk=query_chunk)
    return out.transpose(1, 2)
