"""Dense causal attention (the `dense` kind) against a naive materialised reference."""

from __future__ import annotations

import torch

from openglm.model.attend import attend_dense
from openglm.model.masks import visible_mask


def naive(q, k, v, allowed, scale):
    """q [B,T,H,D], k/v [B,N,Hk,*], allowed [B,T,N] -> [B,T,H,Dv] (full score matrix in memory)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bthd,bnhd->bhtn", q, k) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhtn,bnhd->bthd", s, v)


def test_dense_respects_causality_and_padding_with_a_cache_offset():
    torch.manual_seed(1)
    B, T, N, H, D = 2, 4, 9, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, N, 1, D), torch.randn(B, N, 1, D)
    key_valid = torch.ones(B, N, dtype=torch.bool)
    key_valid[1, :3] = False  # left padding in row 1
    past = N - T
    allowed = visible_mask(key_valid, past, T, N, B)
    out = attend_dense(q, k, v, key_valid, past, 0.5, query_chunk=3)
    assert torch.allclose(out, naive(q, k, v, allowed, 0.5), atol=1e-5)
    out = attend_dense(q, k, v, None, past, 0.5)
    assert torch.allclose(out, naive(q, k, v, visible_mask(None, past, T, N, B).expand(B, -1, -1), 0.5), atol=1e-5)
