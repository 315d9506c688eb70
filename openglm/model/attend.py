"""Attention kernels shared by every attention kind (DSA, dense, and the sparse patterns).

Both take queries [B, T, H, D] and keys/values with Hk <= H heads ([B, N, Hk, D]; H = Hk * groups,
as in GQA; MLA in latent form is Hk = 1), and return [B, T, H, Dv].
- `attend_gathered`: each query reads only its own K selected key positions (gather, O(T*K)).
- `attend_dense`: each query reads every visible key (fused SDPA, O(T*N) time, blocked memory).
Queries are processed in blocks so peak memory stays near `block_bytes`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from openglm.model.masks import visible_mask

BLOCK_BYTES = 2 << 20  # small blocks reuse heap memory; big fresh allocations page-fault
SMALL_ROWS = 64  # gathered attention of at most this many queries (decode) computes in fp32


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
    per_query = B * K * Hk * (D + (v.shape[-1] if v is not None else 0)) * q.element_size()
    block = min(T, query_chunk or max(1, block_bytes // max(per_query, 1)))
    # Gather whole rows with index_select on a [B*S, ...] matrix of rows: far faster than advanced indexing.
    k_rows, stride = key_rows(k)
    v_rows = v.reshape(B * N, -1) if v is not None else None
    if v is not None and stride != N:
        k_rows, stride = k.reshape(B * N, Hk * D), N
    offsets = torch.arange(0, B * stride, stride, device=q.device)[:, None, None]
    # One gather buffer reused by every block: fresh multi-MB allocations would page-fault each time.
    k_buf = k_rows.new_empty(B * block * K, k_rows.shape[1]) if block < T else None
    out = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        rows = (indices[:, t0:t1] + offsets).view(-1)
        if k_buf is None or (torch.is_grad_enabled() and k_rows.requires_grad):  # out= is not differentiable
            k_g = torch.index_select(k_rows, 0, rows)
        else:
            k_g = torch.index_select(k_rows, 0, rows, out=k_buf[: rows.numel()])
        ok = None
        if valid is not None:
            ok = valid[:, t0:t1]
            ok = ok | ~ok.any(-1, keepdim=True)  # rows with nothing visible: avoid NaN
        v_g = None if v is None else v_rows.index_select(0, rows)
        out.append(_attend_rows(q[:, t0:t1], k_g[:, : Hk * D], v_g, ok, scale, v_dim, Hk))
    return torch.cat(out, 1) if len(out) > 1 else out[0]


def _attend_rows(q, k_g, v_g, ok, scale: float, v_dim, Hk: int):
    """Attention of q [B, s, H, D] over its own gathered rows k_g [B*s*K, Hk*D] (values v_g [B*s*K, Hk*Dv],
    or None: the keys' first v_dim channels); ok [B, s, K] bool or None. Returns [B, s, H, Dv]."""
    B, s, H, D = q.shape
    K = k_g.shape[0] // (B * s)
    if Hk == 1:  # MQA / MLA latent: one [H, D] x [D, K] product per query, no head axis on the keys
        # A decode step's products are tiny: in bf16/fp16 they run in fp32, as oneDNN's set-up for a
        # reduced-precision bmm this small costs more than converting the rows (accumulation is fp32 anyway).
        work = torch.float32 if B * s <= SMALL_ROWS and not torch.is_grad_enabled() else q.dtype
        k3 = k_g.view(B * s, K, D).to(work)
        scores = torch.bmm(q.reshape(B * s, H, D).to(work), k3.transpose(1, 2)).float().mul_(scale)  # [B*s, H, K]
        if ok is not None:
            scores.masked_fill_(~ok.view(B * s, 1, K), float("-inf"))
        p = scores.softmax(-1).to(work)
        values = k3[..., :v_dim] if v_g is None else v_g.view(B * s, K, -1).to(work)
        return torch.bmm(p, values).view(B, s, H, -1).to(q.dtype)
    kh = k_g.view(B, s, K, Hk, D).transpose(2, 3)  # [B, s, Hk, K, D]
    scores = torch.matmul(q.reshape(B, s, Hk, H // Hk, D), kh.transpose(-1, -2)).float() * scale
    if ok is not None:
        scores = scores.masked_fill(~ok[:, :, None, None, :], float("-inf"))
    p = scores.softmax(-1).to(q.dtype)
    if v_g is None:  # values are the keys' leading channels: multiply by the whole rows, slice after
        o = torch.matmul(p, kh)[..., :v_dim]
    else:
        o = torch.matmul(p, v_g.view(B, s, K, Hk, -1).transpose(2, 3))
    return o.reshape(B, s, H, -1)


def key_rows(k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """k [B, N, ...] as a contiguous matrix of rows [B*S, W] in which row b*S + n starts with k[b, n]
    (its first k[0, 0].numel() columns), and S.

    Without copying when every k[b, n] is one contiguous run and batches are whole rows apart (a view
    of a preallocated cache: S is its capacity and W its full row, which may hold more entries after
    the key); otherwise a contiguous copy with S = N and W = the key width. Rows are gathered whole
    (index_select on contiguous rows is a memcpy per row; on strided ones it is ~10x slower).
    """
    B, N = k.shape[:2]
    width = math.prod(k.shape[2:])
    if k.is_contiguous() or not (B and N):
        return k.reshape(B * N, width), N
    row = k.stride(1)
    if _inner_contiguous(k) and row >= width and k.stride(0) % row == 0:
        step = k.stride(0) // row
        end = k.storage_offset() + B * step * row
        if step >= N and end * k.element_size() <= k.untyped_storage().nbytes():
            return k.as_strided((B * step, row), (row, 1)), step
    return k.reshape(B * N, width), N


def _inner_contiguous(k: torch.Tensor) -> bool:
    """Whether each k[b, n] is one contiguous run (what k[b, n].is_contiguous() says, without the views)."""
    expected = 1
    for size, stride in zip(reversed(k.shape[2:]), reversed(k.stride()[2:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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
