"""The DeepSeek Sparse Attention (DSA) lightning indexer of GLM-5.

For each query it scores every visible key with a few small heads,
    score(t, j) = sum_h w_h(x_t) * relu(q_h(t) . k(j) / sqrt(d)),   w_h = weights_proj(x_t) / sqrt(H)
(one LayerNorm'd key head shared by all index heads, interleaved RoPE on the first
qk_rope_head_dim dims), and keeps the `index_topk` best. Scores are computed in query
blocks, so memory is O(block * N) rather than O(N^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.config import ModelConfig
from openglm.model.masks import visible_mask
from openglm.model.rope import apply_rope

SCORE_BLOCK_BYTES = 1 << 20  # one block of fp32 per-head scores; small blocks reuse heap memory


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.query_chunk = cfg.attn_query_chunk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5

    def keys(self, x: torch.Tensor, rot: torch.Tensor, projected=None) -> torch.Tensor:
        """The indexer key of each new token, [B, T, index_head_dim] (what the cache stores as `index_k`);
        rot: `Rotation.index`. `projected`: wk(x) when the caller already computed it (fused with its own
        projections)."""
        return apply_rope(self.k_norm(self.wk(x) if projected is None else projected), rot)

    @torch.no_grad()
    def select(self, x, rot, index_k, key_valid, past: int, projected, head_weights=None):
        """Top-k key positions per query: (indices [B,T,k] long, valid [B,T,k] bool or None = all), or None when
        every visible key fits in the budget (then DSA is exactly dense causal attention).
        rot: `Rotation.index`; `projected`: wq_b(q_resid) [B, T, n_heads * head_dim]; `head_weights`:
        weights_proj(x) when the caller already computed it (in fp32)."""
        B, T, _ = x.shape
        N = index_k.shape[1]
        if N <= self.topk:
            return None
        q = apply_rope(projected.view(B, T, self.n_heads, self.head_dim), rot).float()
        # weights_proj runs in fp32 (transformers keeps it fp32 too): it scales every score. The positive
        # softmax scale is applied here too: relu(s * q.k) = s * relu(q.k) for s > 0.
        if head_weights is None:
            head_weights = F.linear(x.float(), self.weights_proj.weight.float())
        w = head_weights.float() * (self.n_heads ** -0.5 * self.softmax_scale)
        kt = index_k.float().transpose(-1, -2)  # [B, D, N]
        block = self.query_chunk or max(1, SCORE_BLOCK_BYTES // (4 * B * self.n_heads * N))
        indices, valid = [], []
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            if past + t1 <= self.topk:  # each query sees only keys in the first topk slots: it takes them all
                indices.append(torch.arange(self.topk, device=x.device).expand(B, t1 - t0, self.topk))
                valid.append(visible_mask(key_valid, past + t0, t1 - t0, N, B)[..., : self.topk].expand(B, -1, -1))
                continue
            # One [s*H, D] x [D, N] product per sequence (a broadcast matmul would copy the keys per query).
            qs = q[:, t0:t1].reshape(B, (t1 - t0) * self.n_heads, self.head_dim)
            scores = torch.bmm(qs, kt).relu_().view(B * (t1 - t0), self.n_heads, N)
            scores = torch.bmm(w[:, t0:t1].reshape(B * (t1 - t0), 1, self.n_heads), scores).view(B, t1 - t0, N)
            if T == 1 and key_valid is None:  # a decode step without padding sees every key
                return scores.topk(self.topk, dim=-1)[1], None
            scores = scores.masked_fill(~visible_mask(key_valid, past + t0, t1 - t0, N, B), float("-inf"))
            top, idx = scores.topk(self.topk, dim=-1)
            indices.append(idx)
            valid.append(top > float("-inf"))
        return torch.cat(indices, 1), torch.cat(valid, 1)
