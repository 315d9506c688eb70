"""The reusable attention kernels against a naive materialised reference."""

from __future__ import annotations

import torch

from openglm.model.attend import attend_dense, attend_gathered
from openglm.model.masks import visible_mask


def naive(q, k, v, allowed, scale):
    """q [B,T,H,D], k/v [B,N,Hk,*], allowed [B,T,N] -> [B,T,H,Dv] (full score matrix in memory)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bthd,bnhd->bhtn", q, k) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhtn,bnhd->bthd", s, v)


def test_gathered_equals_dense_with_the_same_key_set():
    torch.manual_seed(0)
    B, T, N, H, Hk, D, K = 2, 5, 12, 4, 2, 8, 4
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, N, Hk, D), torch.randn(B, N, Hk, 6)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B * T)]).view(B, T, K)
    valid = torch.rand(B, T, K) > 0.3
    valid[..., 0] = True
    allowed = torch.zeros(B, T, N, dtype=torch.bool)
    allowed.scatter_(2, idx, valid)
    out = attend_gathered(q, k, v, idx, valid, 0.3, query_chunk=2)
    assert torch.allclose(out, naive(q, k, v, allowed, 0.3), atol=1e-5)
    # MLA style: values are the first v_dim channels of the (single-head) keys
    k1 = torch.randn(B, N, 1, D)
    out = attend_gathered(q, k1, None, idx, valid, 0.3, v_dim=5)
    assert torch.allclose(out, naive(q, k1, k1[..., :5], allowed, 0.3), atol=1e-5)


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


def test_gathered_single_key_head_in_bf16_without_autograd_matches_fp32():
    """The decode-sized path: one key head (MQA / MLA latent), separate values or key-prefix values,
    bf16 inputs computed in fp32 without autograd, a padded slot per query."""
    torch.manual_seed(2)
    B, T, N, H, D, K = 3, 2, 10, 4, 8, 5
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, N, 1, D), torch.randn(B, N, 1, 6)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B * T)]).view(B, T, K)
    valid = torch.ones(B, T, K, dtype=torch.bool)
    valid[..., -1] = False
    allowed = torch.zeros(B, T, N, dtype=torch.bool).scatter_(2, idx, valid)
    bf = [t.bfloat16() for t in (q, k, v)]
    with torch.no_grad():
        out = attend_gathered(*bf, idx, valid, 0.3)
        out_mla = attend_gathered(bf[0], bf[1], None, idx, valid, 0.3, v_dim=5)
    ref = naive(*(t.float() for t in bf), allowed, 0.3)
    ref_mla = naive(bf[0].float(), bf[1].float(), bf[1][..., :5].float(), allowed, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H, 6)
    assert (out.float() - ref).abs().max() <= 1e-2 and (out_mla.float() - ref_mla).abs().max() <= 1e-2
