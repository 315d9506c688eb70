"""Rotary position embedding on the rope slice (default or YaRN), applied in interleaved layout.

GLM-5 (like DeepSeek) rotates interleaved pairs (x0,x1),(x2,x3),...: each pair is one complex
number multiplied by a unit rotation (times the YaRN attention scale), in place in the layout. The
reference writes the rotated pairs de-interleaved ([evens | odds]); that is a permutation applied to
queries and keys alike, so their dot products (all attention reads) are the same either way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from openglm.model.config import ModelConfig, yarn_mscale


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for a rope slice of `cfg.rope_dim` (MLA's qk_rope_head_dim, GQA's partial slice),
    and the cos/sin scale."""
    rp = cfg.rope_parameters
    dim, base = cfg.rope_dim, float(rp["rope_theta"])
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


class Rotation(NamedTuple):
    """One forward's rotations, unit complex numbers times the attention scale: `rope` [B, T, rope_dim/2]
    for the MLA rope slice; `index` [B, T, index_head_dim/2] for the indexer's whole head (its pairs past
    the rope slice get 1 + 0i, so one multiply rotates the slice and leaves the rest as it is)."""
    rope: torch.Tensor
    index: torch.Tensor


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.index_pairs = cfg.index_head_dim // 2

    def _apply(self, fn, recurse=True):
        # The frequencies stay fp32 whatever dtype the model is cast to: rounded to bf16 they would turn
        # the angles of far positions noticeably (and differ from a checkpoint loaded straight to bf16).
        exact = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = exact.to(self.inv_freq.device, torch.float32)
        return self

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> Rotation:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        rope = torch.polar(torch.full_like(freqs, self.attention_scaling), freqs)  # scale * e^(i freqs)
        pad = self.index_pairs - rope.shape[-1]
        index = torch.cat([rope, rope.new_ones(*rope.shape[:-1], pad)], -1) if pad > 0 else rope
        return Rotation(rope, index)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [B, T, ..., 2P] with each interleaved pair (x[2i], x[2i+1]) rotated by rot [B, T, P] (complex,
    broadcast over the middle dims); computed in fp32, returned in x's dtype. (Runs ~10 times per layer in
    a decode step, so it avoids every call that is not needed.)"""
    extra = x.dim() - rot.dim()
    r = (rot if extra == 0 else rot.unsqueeze(2) if extra == 1
         else rot.view(rot.shape[:2] + (1,) * extra + rot.shape[2:]))
    xf = x if x.dtype == torch.float32 else x.float()
    try:  # the pairs as complex numbers: a view when the layout allows (a slice of a projection usually does)
        xc = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
    except RuntimeError:  # odd storage offset or stride
        xc = torch.view_as_complex(xf.contiguous().unflatten(-1, (-1, 2)))
    out = torch.view_as_real(xc * r).flatten(-2)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
