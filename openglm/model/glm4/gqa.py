"""Grouped-query attention of `glm4_moe` (GLM-4.5 / 4.5-Air / 4.6 / 4.7).

q/k/v projections (bias = attention_bias), optional per-head RMSNorm on queries and keys (use_qk_norm),
RoPE on the first `rope_dim` = head_dim * partial_rotary_factor dims of each head in NeoX layout (the slice's
two halves are the pair (x_i, x_{i+d/2}), as transformers' rotate_half), the rest passes through; the
cache holds the rotated keys and the values per KV head; o_proj has no bias.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model import fast
from openglm.model.attend import attend_dense
from openglm.model.config import ModelConfig
from openglm.model.norm import RMSNorm


class GQAttention(nn.Module):
    kind = "dense"  # every query reads every visible key (no DSA selection to pass on)
    indexer = None  # no DSA indexer (the decoder loop asks)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.gqa_head_dim
        self.scale = self.head_dim ** -0.5
        self.query_chunk = cfg.attn_query_chunk
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.use_qk_norm = cfg.use_qk_norm

    def forward(self, x, rot, key_valid, past: int, cache=None, prev_selection=None, ops: fast.Reference | None = None):
        """Same call as MLAttention's; returns (output [B,T,hidden], None)."""
        ops = ops or fast.choose(x)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.use_qk_norm:
            q, k = ops.norm(self.q_norm, q), ops.norm(self.k_norm, k)
        q, k = rope_halves(q, rot.rope), rope_halves(k, rot.rope)
        if cache is not None:
            entries = cache.update(self.layer_idx, {"k": k, "v": v})
            k, v = entries["k"], entries["v"]
        o = attend_dense(q, k, v, key_valid, past, self.scale, self.query_chunk)
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim)), None


def rope_halves(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with its first 2P dims rotated in NeoX layout by rot [B, T, P] (complex: the attention
    scale times e^(i angle)); computed in fp32, returned in x's dtype."""
    P = rot.shape[-1]
    r = rot.unsqueeze(2)
    cos, sin = r.real, r.imag
    xf = x.float()
    x1, x2, rest = xf[..., :P], xf[..., P:2 * P], xf[..., 2 * P:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(x.dtype)
