"""glm4_moe (GQA, partial RoPE, optional QK-norm, attention bias) and glm4_moe_lite (MLA without DSA): logits
parity with transformers 5.23.0's Glm4MoeForCausalLM / Glm4MoeLiteForCausalLM (eager attention, fp32, padded
batch), and checkpoints in both directions."""

from __future__ import annotations

import pytest
import torch

import openglm
from openglm.model import ModelConfig, save_pretrained

TOL = 1e-4

VARIANTS = {
    "glm4_moe+qk_norm": ("tiny-glm4-moe", dict(use_qk_norm=True)),
    "glm4_moe": ("tiny-glm4-moe", dict(use_qk_norm=False, attention_bias=False, num_key_value_heads=4)),
    "glm4_moe+yarn": ("tiny-glm4-moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                             "factor": 4.0, "partial_rotary_factor": 0.25,
                                                             "original_max_position_embeddings": 512})),
    "glm4_moe_lite": ("tiny-glm4-moe-lite", dict()),
}


def _masked_diff(a, b, mask):
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_padded_batch(variant, make_pair, padded_batch):
    preset, overrides = VARIANTS[variant]
    cfg = ModelConfig.from_preset(preset, **overrides)
    hf, ours = make_pair(cfg)
    ids, mask, pos = padded_batch(cfg.vocab_size, [21, 14, 7])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, attention_mask=mask).logits
    assert ref.abs().max() > 1.0
    assert _masked_diff(ref, out, mask) <= TOL


def test_qk_norm_and_bias_change_the_output(make_pair, padded_batch):
    """Guards against a vacuous parity: the QK-norm gains and the q/k/v biases move the logits."""
    cfg = ModelConfig.from_preset("tiny-glm4-moe")
    _, ours = make_pair(cfg)
    ids, mask, _ = padded_batch(cfg.vocab_size, [12, 12])
    with torch.no_grad():
        base = ours(ids).logits
        ours.model.layers[0].self_attn.q_norm.weight.mul_(1.5)
        assert (ours(ids).logits - base).abs().max() > 1e-3
        ours.model.layers[0].self_attn.v_proj.bias.add_(0.5)
        assert (ours(ids).logits - base).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["glm4_moe+qk_norm", "glm4_moe", "glm4_moe_lite"])
def test_checkpoints_both_directions(variant, tmp_path, make_pair, padded_batch):
    preset, overrides = VARIANTS[variant]
    cfg = ModelConfig.from_preset(preset, **overrides)
    hf, ours = make_pair(cfg, seed=2)
    ids, mask, pos = padded_batch(cfg.vocab_size, [16, 9], seed=2)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    hf.save_pretrained(tmp_path / "hf")  # transformers -> openglm
    loaded = openglm.load_model(tmp_path / "hf")
    assert loaded.config.model_type == cfg.model_type
    with torch.no_grad():
        assert _masked_diff(ref, loaded(ids, attention_mask=mask).logits, mask) <= TOL
    save_pretrained(ours, tmp_path / "ours")  # openglm -> transformers
    HFModel = type(hf)
    back = HFModel.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        assert _masked_diff(ref, back(input_ids=ids, attention_mask=mask, position_ids=pos).logits, mask) <= TOL


def test_decode_with_cache_matches_full_forward(make_pair):
    cfg = ModelConfig.from_preset("tiny-glm4-moe")
    _, ours = make_pair(cfg, seed=4)
    from openglm.model import DynamicCache

    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = ours(ids).logits
        cache = DynamicCache()
        steps = [ours(ids[:, :8], cache=cache).logits]
        for t in range(8, 12):
            steps.append(ours(ids[:, t:t + 1], cache=cache).logits)
    assert (torch.cat(steps, 1) - full).abs().max() <= TOL
