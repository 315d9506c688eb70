"""The exported config.json holds every key vLLM's and SGLang's GLM model code reads, with values that make them
compute what openglm computes.

Key sets derived by reading (read-only) the engines' sources:
- vLLM `vllm/model_executor/models/deepseek_v2.py` @ 002d6073aa034d4f5545d45021b0e56d1f3c3593
  (`GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM)`; the MoE reads topk_method == "noaux_tc" to create
  e_score_correction_bias and scoring_func (default "softmax"); MoE layers are `layer >= first_k_dense_replace
  and layer % moe_layer_freq == 0`; a layer has an indexer unless index_topk_pattern[layer] == "S" (or, without a
  pattern, the index_topk_freq / index_skip_topk_offset rule); the indexer's RoPE is NeoX unless
  indexer_rope_interleave; next-n layers come from num_nextn_predict_layers), and
  `vllm/model_executor/models/glm4_moe.py` @ 002d6073aa034d4f5545d45021b0e56d1f3c3593 (GQA: head_dim,
  use_qk_norm, attention_bias, rope_parameters.partial_rotary_factor; MoE by first_k_dense_replace).
- SGLang `python/sglang/srt/models/deepseek_v2.py` @ 00114aef19bbb7431b9cfc5a77dce64b9c53ed95 (`MoEGate` reads
  config.topk_method without a default, so a config without it fails at init; the MoE keys below) and
  `python/sglang/srt/configs/model_config.py` @ 001adf564fd332c285397a46a034ee2f93ba7515 (`is_deepseek_dsa`:
  architectures has GlmMoeDsaForCausalLM and index_topk is set; index_head_dim, index_n_heads, index_topk).
"""

from __future__ import annotations

import pytest

from openglm.model import ModelConfig
from openglm.model.config import export_warnings

MOE_KEYS = {"n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "intermediate_size", "hidden_act", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
            "topk_method", "scoring_func", "first_k_dense_replace", "moe_layer_freq"}
COMMON_KEYS = {"architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
               "rope_parameters", "rope_theta", "num_nextn_predict_layers", "tie_word_embeddings"}
MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
DSA_KEYS = {"index_topk", "index_n_heads", "index_head_dim", "index_topk_pattern", "index_topk_freq",
            "index_skip_topk_offset", "indexer_rope_interleave"}
GQA_KEYS = {"head_dim", "use_qk_norm", "attention_bias", "partial_rotary_factor"}
ENGINE_KEYS = {"glm_moe_dsa": COMMON_KEYS | MOE_KEYS | MLA_KEYS | DSA_KEYS,
               "glm4_moe_lite": COMMON_KEYS | MOE_KEYS | MLA_KEYS,
               "glm4_moe": COMMON_KEYS | MOE_KEYS | GQA_KEYS}
PRESETS = {"glm_moe_dsa": "tiny", "glm4_moe_lite": "tiny-glm4-moe-lite", "glm4_moe": "tiny-glm4-moe"}


def vllm_has_indexer(d: dict, layer: int) -> bool:
    """vLLM's (and SGLang's) rule for which layers build a DSA indexer."""
    pattern = d.get("index_topk_pattern")
    if pattern is None:
        return max(layer - d.get("index_skip_topk_offset", 2) + 1, 0) % d.get("index_topk_freq", 1) == 0
    return pattern[layer] != "S"


@pytest.mark.parametrize("model_type", list(ENGINE_KEYS))
def test_export_has_every_key_the_engines_read(model_type):
    cfg = ModelConfig.from_preset(PRESETS[model_type], num_nextn_predict_layers=1)
    d = cfg.to_hf_dict()
    assert ENGINE_KEYS[model_type] <= set(d), ENGINE_KEYS[model_type] - set(d)
    assert d["topk_method"] == "noaux_tc" and d["scoring_func"] == "sigmoid"  # e_score_correction_bias + sigmoid
    assert d["num_nextn_predict_layers"] == 1 and d["moe_layer_freq"] == 1
    # the engines' MoE-layer rule gives openglm's mlp_layer_types
    moe = [i >= d["first_k_dense_replace"] and i % d["moe_layer_freq"] == 0 for i in range(cfg.num_hidden_layers)]
    assert moe == [t == "sparse" for t in cfg.mlp_layer_types]
    assert d["rope_theta"] == cfg.rope_parameters["rope_theta"]


def test_glm5_indexer_schedule_and_rope_layout():
    cfg = ModelConfig.from_preset("tiny", indexer_types=["full", "shared", "shared"])
    d = cfg.to_hf_dict()
    assert d["indexer_rope_interleave"] is True  # openglm rotates the indexer's pairs interleaved
    assert [vllm_has_indexer(d, i) for i in range(3)] == [True, False, False]
    assert d["architectures"] == ["GlmMoeDsaForCausalLM"] and d["index_topk"] == cfg.index_topk


def test_lite_export_has_no_dsa_keys():
    """vLLM builds the DSA indexer whenever the config has index_topk: the lite model must not have it."""
    d = ModelConfig.from_preset("tiny-glm4-moe-lite").to_hf_dict()
    assert not {"index_topk", "index_n_heads", "index_head_dim", "indexer_types"} & set(d)
    assert d["architectures"] == ["Glm4MoeLiteForCausalLM"] and d["rope_interleave"] is True


def test_gqa_export_spells_out_head_dim_and_partial_rope():
    cfg = ModelConfig.from_preset("tiny-glm4-moe", head_dim=None)  # default: hidden_size // heads
    d = cfg.to_hf_dict()
    assert d["head_dim"] == 16 and d["partial_rotary_factor"] == 0.5
    assert d["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert not MLA_KEYS & set(d) and "mlp_layer_types" not in d


def test_export_warns_what_the_engines_cannot_reproduce():
    assert export_warnings(ModelConfig.from_preset("tiny")) == []
    w = export_warnings(ModelConfig.from_preset("tiny", router="softmax", capacity_factor=1.0,
                                                mlp_layer_types=["dense", "sparse", "dense"],
                                                attention_kinds=["dsa", "dense", "dsa"],
                                                indexer_types=["full", "full", "shared"]))
    assert len(w) == 4 and any("router='softmax'" in x for x in w) and any("mlp_layer_types" in x for x in w)
    d = ModelConfig.from_preset("tiny", router="softmax").to_hf_dict()
    assert d["scoring_func"] == "softmax" and d["topk_method"] == "greedy"
