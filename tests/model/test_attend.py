"""Attention in the model's layout ([B, T, H, D] queries, [B, N, Hk, D] keys) against a naive materialised
reference: dense causal attention (`attend_dense`, the `dense` kind) and DSA's gather over selected slots
(`sparse_dsa.gather_attention`, passed transposed views as the model does)."""

from __future__ import annotations

import torch

from openglm.model.attend import attend_dense
from openglm.model.glm5 import sparse_dsa
from openglm.model.glm5.sparse_dsa import gather_attention
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


def model_layout_gather(q, k, v, slots, scale):
    """gather_attention on the model's [B, T, H, D] / [B, N, Hk, D] tensors, passed as transposed views."""
    return gather_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), slots, scale=scale).transpose(1, 2)


def test_few_query_gather_equals_dense_with_the_same_key_set():
    """The decode-sized path (<= FEW_QUERIES queries: one batched gather) on strided views, GQA and MLA-style
    values (the keys' leading channels, gathered once with them)."""
    torch.manual_seed(0)
    B, T, N, H, Hk, D, K = 2, 5, 12, 4, 2, 8, 4
    assert T <= sparse_dsa.FEW_QUERIES
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, N, Hk, D), torch.randn(B, N, Hk, 6)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B * T)]).view(B, T, K)
    valid = torch.rand(B, T, K) > 0.3
    valid[..., 0] = True
    allowed = torch.zeros(B, T, N, dtype=torch.bool).scatter_(2, idx, valid)
    slots = idx.masked_fill(~valid, -1)
    assert torch.allclose(model_layout_gather(q, k, v, slots, 0.3), naive(q, k, v, allowed, 0.3), atol=1e-5)
    k1 = torch.randn(B, N, 1, D)
    out = model_layout_gather(q, k1, k1[..., :5], slots, 0.3)
    assert torch.allclose(out, naive(q, k1, k1[..., :5], allowed, 0.3), atol=1e-5)


def test_few_query_gather_in_bf16_without_autograd_matches_fp32():
    """bf16 inputs of a decode-sized block are computed in fp32 without autograd; one key head (MQA / MLA
    latent), separate values or key-prefix values, an unused slot per query."""
    torch.manual_seed(2)
    B, T, N, H, D, K = 3, 2, 10, 4, 8, 5
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, N, 1, D), torch.randn(B, N, 1, 6)
    idx = torch.stack([torch.randperm(N)[:K] for _ in range(B * T)]).view(B, T, K)
    valid = torch.ones(B, T, K, dtype=torch.bool)
    valid[..., -1] = False
    allowed = torch.zeros(B, T, N, dtype=torch.bool).scatter_(2, idx, valid)
    slots = idx.masked_fill(~valid, -1)
    bf = [t.bfloat16() for t in (q, k, v)]
    with torch.no_grad():
        out = model_layout_gather(*bf, slots, 0.3)
        out_mla = model_layout_gather(bf[0], bf[1], bf[1][..., :5], slots, 0.3)
    ref = naive(*(t.float() for t in bf), allowed, 0.3)
    ref_mla = naive(bf[0].float(), bf[1].float(), bf[1][..., :5].float(), allowed, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H, 6)
    assert (out.float() - ref).abs().max() <= 1e-2 and (out_mla.float() - ref_mla).abs().max() <= 1e-2
