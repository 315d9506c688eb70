"""Rotary position embedding on the rope slice (default or YaRN), applied in interleaved layout.

GLM-5 (like DeepSeek) rotates interleaved pairs (x0,x1),(x2,x3),...; the result is written
de-interleaved ([rotated evens | rotated odds]). Queries and keys get the same permutation, so
their dot products are unchanged; cached rope keys are stored in this rotated layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openglm.model.config import ModelConfig, yarn_mscale


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a rope slice of `qk_rope_head_dim`, and the cos/sin scale."""
    rp = cfg.rope_parameters
    dim, base = cfg.qk_rope_head_dim, float(rp["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rp.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    return _yarn(rp, dim, base, pos_freqs, cfg.max_position_embeddings)


def _yarn(rp: dict, dim: int, base: float, pos_freqs: torch.Tensor, max_pos: int):
    factor = rp.get("factor")
    orig = rp.get("original_max_position_embeddings", max_pos)
    if factor is None:
        factor = max_pos / orig
    attention_factor = rp.get("attention_factor")
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength spans `rotations` turns over `orig`
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN with `mscale_all_dim` (as GLM-5/DeepSeek do)."""
    scale = cfg.qk_head_dim ** -0.5
    rp = cfg.rope_parameters
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        m = yarn_mscale(rp["factor"], rp["mscale_all_dim"])
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [B, T, rope_dim/2] (one angle per rotated pair)."""
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, T, ..., d] by cos/sin [B, T, d/2] (broadcast over middle dims)."""
    extra = x.dim() - cos.dim()
    shape = cos.shape[:2] + (1,) * extra + cos.shape[2:]
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
