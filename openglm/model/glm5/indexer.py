"""The DeepSeek Sparse Attention (DSA) lightning indexer of GLM-5: its parameters and projections.

For each query it scores every visible key with a few small heads,
    score(t, j) = sum_h w_h(x_t) * relu(q_h(t) . k(j) / sqrt(d)),   w_h = weights_proj(x_t) / sqrt(H)
(one LayerNorm'd key head shared by all index heads, interleaved RoPE on the first
qk_rope_head_dim dims), and keeps the `index_topk` best. This module computes the indexer's keys,
queries and head weights; the scoring, top-k and the attention over the selected keys are
`sparse_dsa.dsa_attention` (the model's one DSA implementation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.config import ModelConfig
from openglm.model.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
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

    def entries(self, x: torch.Tensor, rot, projected=None) -> dict[str, torch.Tensor]:
        """What the cache holds for this indexer per new token: its keys (`rot`: the forward's `rope.Rotation`)."""
        return {"index_k": self.keys(x, rot.index, projected)}

    @torch.no_grad()
    def queries(self, x, rot, projected, head_weights=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries [B, T, n_heads, head_dim] and head weights [B, T, n_heads] (scaled by
        1/sqrt(n_heads)), both fp32, as `sparse_dsa.dsa_attention` takes them (its index_scale is
        `softmax_scale`). No gradients: the selection picks keys, it does not weight them.
        rot: `Rotation.index`; `projected`: wq_b(q_resid) [B, T, n_heads * head_dim]; `head_weights`:
        weights_proj(x) when the caller already computed it (in fp32)."""
        B, T, _ = x.shape
        q = apply_rope(projected.view(B, T, self.n_heads, self.head_dim), rot).float()
        # weights_proj runs in fp32 (transformers keeps it fp32 too): it scales every score.
        if head_weights is None:
            head_weights = F.linear(x.float(), self.weights_proj.weight.float())
        return q, head_weights.float() * self.n_heads ** -0.5
