"""Attention kernels shared by every attention kind (DSA, dense, and the sparse patterns).

Both take queries [B, T, H, D] and keys/values with Hk <= H heads ([B, N, Hk, D]; H = Hk * groups,
as in GQA; MLA in latent form is Hk = 1), and return [B, T, H, Dv].
- `attend_gathered`: each query reads only its own K selected key positions (gather, O(T*K)).
- `attend_dense`: each query reads every visible key (fused SDPA, O(T*N) time, blocked memory).
Queries are processed in blocks so peak memory stays near `block_bytes`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openglm.model.masks import visible_mask

BLOCK_BYTES = 2 << 20  # small blocks reuse heap memory; big fresh allocations page-fault


def attend_gathered(q, k, v, indices, valid, scale: float, v_dim: int | None = None,
                    query_chunk: int | None = None, block_bytes: int = BLOCK_BYTES):
    """Attention over gathered entries.

    q [B,T,H,D]; k [B,N,Hk,D]; v [B,N,Hk,Dv] or None (then values are k[..., :v_dim], as in MLA
    where the latent is both key and value); indices [B,T,K] (long, key positions); valid [B,T,K]
    (bool, False = ignore that slot; None = all slots valid). A query with no valid slot gets a finite,
    meaningless output.
    """
    B, T, H, D = q.shape
    N, Hk, K = k.shape[1], k.shape[2], indices.shape[-1]
    g = H // Hk
    per_query = B * K * Hk * (D + (v.shape[-1] if v is not None else 0)) * q.element_size()
    block = query_chunk or max(1, block_bytes // max(per_query, 1))
    # Gather whole rows with index_select on a [B*S, ...] matrix of rows: far faster than advanced indexing.
    k_rows, stride = key_rows(k)
    v_rows = v.reshape(B * N, -1) if v is not None else None
    if v is not None and stride != N:
        k_rows, stride = k.reshape(B * N, Hk * D), N
    offsets = (torch.arange(B, device=q.device) * stride)[:, None, None]
    # One gather buffer reused by every block: fresh multi-MB allocations would page-fault each time.
    k_buf = k_rows.new_empty(B * min(block, T) * K, k_rows.shape[1])
    out = []
    for t0 in range(0, T, block):
        t1, s = min(T, t0 + block), min(T, t0 + block) - t0
        rows = (indices[:, t0:t1] + offsets).reshape(-1)
        if torch.is_grad_enabled() and k_rows.requires_grad:  # out= is not differentiable (training)
            k_g = torch.index_select(k_rows, 0, rows)
        else:
            k_g = torch.index_select(k_rows, 0, rows, out=k_buf[: rows.numel()])
        k_g = k_g[:, : Hk * D].view(B, s, K, Hk, D).transpose(2, 3)  # [B, s, Hk, K, D]
        qs = q[:, t0:t1].reshape(B, s, Hk, g, D)
        scores = torch.matmul(qs, k_g.transpose(-1, -2)).float() * scale  # [B, s, Hk, g, K]
        if valid is not None:
            ok = valid[:, t0:t1]
            ok = ok | ~ok.any(-1, keepdim=True)  # rows with nothing visible: avoid NaN
            scores = scores.masked_fill(~ok[:, :, None, None, :], float("-inf"))
        p = scores.softmax(-1).to(q.dtype)
        if v is None:  # values are the keys' leading channels: multiply by the whole rows, slice after
            o = torch.matmul(p, k_g)[..., :v_dim]
        else:
            o = torch.matmul(p, v_rows.index_select(0, rows).view(B, s, K, Hk, -1).transpose(2, 3))
        out.append(o.reshape(B, s, H, -1))
    return torch.cat(out, 1) if len(out) > 1 else out[0]


def key_rows(k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """k [B, N, ...] as a contiguous matrix of rows [B*S, W] in which row b*S + n starts with k[b, n]
    (its first k[0, 0].numel() columns), and S.

    Without copying when every k[b, n] is one contiguous run and batches are whole rows apart (a view
    of a preallocated cache: S is its capacity and W its full row, which may hold more entries after
    the key); otherwise a contiguous copy with S = N and W = the key width. Rows are gathered whole
    (index_select on contiguous rows is a memcpy per row; on strided ones it is ~10x slower).
    """
    B, N = k.shape[:2]
    width = k[0, 0].numel() if B and N else 0
    if k.is_contiguous() or not (B and N):
        return k.reshape(B * N, width), N
    row = k.stride(1)
    if k[0, 0].is_contiguous() and row >= width and k.stride(0) % row == 0:
        step = k.stride(0) // row
        end = k.storage_offset() + B * step * row
        if step >= N and end * k.element_size() <= k.untyped_storage().nbytes():
            return k.as_strided((B * step, row), (row, 1)), step
    return k.reshape(B * N, width), N


def attend_dense(q, k, v, key_valid, past: int, scale: float, query_chunk: int | None = None,
                 block_bytes: int = BLOCK_BYTES):
    """Causal attention over all visible keys with the fused SDPA kernel.

    q [B,T,H,D]; k [B,N,Hk,D]; v [B,N,Hk,Dv]; key_valid [B,N] bool or None (no padding);
    query i sits at cache index past+i.
    """
    B, T, H, _ = q.shape
    N, Hk = k.shape[1], k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = Hk != H
    if key_valid is None and (T == 1 or (past == 0 and T == N)) and query_chunk is None:
        # No padding: one fused call, with the causal flag when it lines up with cache order.
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=T > 1, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2)
    block = query_chunk or max(1, block_bytes // max(B * H * N * 4, 1))
    out = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        mask = visible_mask(key_valid, past + t0, t1 - t0, N, B)
        mask = (mask | ~mask.any(-1, keepdim=True)).unsqueeze(1)  # rows with nothing visible: avoid NaN
        out.append(F.scaled_dot_product_attention(qh[:, :, t0:t1], kh, vh, attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa))
    return torch.cat(out, 2).transpose(1, 2)
