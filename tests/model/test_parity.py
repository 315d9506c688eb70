"""Logits parity with transformers' GlmMoeDsaForCausalLM (eager attention), fp32."""

from __future__ import annotations

import pytest
import torch

from openglm.model import ModelConfig

TOL = 1e-4

VARIANTS = {
    "one-group": dict(n_group=1, topk_group=1),
    "grouped": dict(n_group=4, topk_group=2, n_routed_experts=8, num_experts_per_tok=3),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def max_diff_real(a, b, mask):
    return (a - b).abs()[mask.bool()].max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_on_padded_batch(variant, make_pair, padded_batch):
    cfg = ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=8, **VARIANTS[variant])
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse"] and "shared" in cfg.indexer_types
    hf, ours = make_pair(cfg)
    ids, mask, pos = padded_batch(cfg.vocab_size, [24, 17, 9])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = ours(ids, attention_mask=mask).logits  # positions default to cumsum(mask) - 1
    assert out.shape == (3, 24, cfg.vocab_size)
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors
    assert max_diff_real(ref, out, mask) <= TOL


def test_right_padding_and_no_mask_match(tiny_cfg, make_pair, padded_batch):
    hf, ours = make_pair(tiny_cfg, seed=1)
    ids, mask, _ = padded_batch(tiny_cfg.vocab_size, [20, 13], left=False, seed=1)
    with torch.no_grad():
        assert max_diff_real(hf(input_ids=ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits,
                             mask) <= TOL
        full = torch.ones_like(mask)
        assert max_diff_real(hf(input_ids=ids).logits, ours(ids).logits, full) <= TOL


def test_sparsity_changes_the_output(tiny_cfg, make_pair, padded_batch):
    """Guard against a vacuous parity: with index_topk < seq, DSA differs from dense attention."""
    _, ours = make_pair(tiny_cfg)
    ids, mask, _ = padded_batch(tiny_cfg.vocab_size, [24, 24])
    dense = tiny_cfg.replace(index_topk=1024)
    from openglm.model import GlmMoeDsaForCausalLM

    ours_dense = GlmMoeDsaForCausalLM(dense).eval()
    ours_dense.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (ours(ids).logits - ours_dense(ids).logits).abs().max() > 1e-2
