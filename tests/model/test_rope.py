"""RoPE: the complex-number rotation equals the pairwise formula, whatever the input's layout, and the
frequencies stay fp32 when the model is cast."""

from __future__ import annotations

import math

import torch

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.rope import RotaryEmbedding, apply_rope


def rotate_pairs(x, angles, scale):
    """Reference: (x[2i], x[2i+1]) -> scale * (x0 cos - x1 sin, x1 cos + x0 sin), in fp64."""
    x, c, s = x.double(), angles.double().cos() * scale, angles.double().sin() * scale
    c = c.view(c.shape[:2] + (1,) * (x.dim() - 3) + c.shape[2:])
    s = s.view(s.shape[:2] + (1,) * (x.dim() - 3) + s.shape[2:])
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2)


def test_apply_rope_equals_the_pairwise_rotation_for_views_and_copies():
    cfg = ModelConfig.from_preset("tiny")
    emb = RotaryEmbedding(cfg)
    pos = torch.tensor([[0, 3, 7], [1, 2, 200]])
    rot = emb(pos)
    angles = pos[..., None].float() * emb.inv_freq
    r = cfg.qk_rope_head_dim
    wide = torch.randn(2, 3, 4, 3 * r + 1)
    for x in (wide[..., :r], wide[..., r:2 * r], wide[..., 1:r + 1],  # even offset, even offset, odd offset
              wide[..., :r].transpose(0, 1).contiguous().transpose(0, 1)):
        out = apply_rope(x, rot.rope)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert (out.double() - rotate_pairs(x, angles, emb.attention_scaling)).abs().max() <= 1e-5
    assert (apply_rope(x.bfloat16(), rot.rope).double() - rotate_pairs(x.bfloat16(), angles, 1.0)).abs().max() <= 0.05


def test_index_rotation_turns_the_rope_slice_and_keeps_the_rest():
    cfg = ModelConfig.from_preset("tiny")
    rot = RotaryEmbedding(cfg)(torch.tensor([[5, 9]]))
    x = torch.randn(1, 2, cfg.index_n_heads, cfg.index_head_dim)
    out = apply_rope(x, rot.index)
    r = cfg.qk_rope_head_dim
    assert torch.equal(out[..., r:], x[..., r:])
    assert torch.allclose(out[..., :r], apply_rope(x[..., :r].contiguous(), rot.rope))


def test_casting_the_model_keeps_exact_fp32_frequencies():
    cfg = ModelConfig.from_preset("tiny", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    m = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    inv_freq = m.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, RotaryEmbedding(cfg).inv_freq)
    assert math.isclose(float(inv_freq[1]), 10000.0 ** (-2 / cfg.qk_rope_head_dim), rel_tol=1e-6)
