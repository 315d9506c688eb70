"""glm5_next's config: read as transformers reads it (nested text_config / linear_attn_config, its defaults and
aliases), bad values as one-line ConfigErrors naming the key, and `openglm info --preset glm-5.3-flash`."""

from __future__ import annotations

import json

import pytest

from openglm.cli import main
from openglm.model import ModelConfig
from openglm.model.checkpoint import read_config
from openglm.model.errors import ConfigError
from openglm.model.glm5_next import Glm5NextForCausalLM
from openglm.model.params import parameter_report

KDA, DSA = "linear_attention", "indexed_attention"


@pytest.mark.parametrize("changes,key", [
    (dict(layer_types=[KDA, DSA, DSA]), "layer_types"),
    (dict(indexer_types=["full", "full", "shared", "full"]), "indexer_types"),
    (dict(index_topk=10), "index_topk"),
    (dict(indexer_types=["full", "shared", "full", "full", "full"]), "indexer_types[1]"),
    (dict(layer_types=[KDA, DSA, "sliding_attention", KDA, DSA]), "layer_types[2]"),
    (dict(qk_rope_head_dim=8), "qk_rope_head_dim"),
    (dict(linear_lower_bound=1.0), "linear_lower_bound"),
    (dict(hc_mult=0), "hc_mult"),
])
def test_bad_config_is_one_line_naming_the_key(changes, key):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_preset("tiny-glm5-next", **changes)
    message = str(e.value)
    assert key in message and "\n" not in message


def test_a_shared_indexer_after_a_full_one_across_kda_layers_is_fine():
    """Layer 0 (KDA) says 'shared' (not a DSA layer: ignored); layer 4 shares layer 2's selection over layer 3 (KDA)."""
    cfg = ModelConfig.from_preset("tiny-glm5-next", layer_types=[KDA, KDA, DSA, KDA, DSA],
                                  indexer_types=["shared", "full", "full", "full", "shared"])
    model = Glm5NextForCausalLM(cfg)
    assert model.model.layers[2].self_attn.selection_shared and model.model.layers[4].self_attn.indexer is None


def test_bad_config_json_names_the_file_and_key(tmp_path):
    d = ModelConfig.from_preset("tiny-glm5-next").to_hf_dict()
    d["text_config"]["index_kpool"] = 3
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        read_config(tmp_path)
    assert "config.json" in str(e.value) and "index_kpool=3" in str(e.value) and "\n" not in str(e.value)


def test_info_refuses_a_bad_override_in_one_line(capsys):
    assert main(["info", "--preset", "tiny-glm5-next", "--set", "index_kpool=3"]) == 1
    err = capsys.readouterr().err
    assert "index_topk=8 is not a multiple of index_kpool=3" in err and err.count("\n") == 1


def test_config_reads_as_transformers_reads_it():
    """A published-style config.json (legacy layer names, linear_attn_config, no mlp_layer_types, a null gate bound
    with the default safe_gate) and a flat text-only one give what transformers' Glm5NextConfig gives."""
    from transformers import Glm5NextConfig

    text = {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 300, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "index_topk": 16, "index_kpool": 4, "index_head_dim": 16, "index_n_heads": 4,
            "layer_types": [KDA, KDA, "deepseek_sparse_attention", KDA, "full_attention", "deepseek_sparse_attention"],
            "index_topk_pattern": "FFFFFS", "moe_intermediate_size": 32, "n_routed_experts": 8,
            "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 3,
                                   "gate_lower_bound": None, "kda_layers": [0, 1, 3]},
            "pad_token_id": 0, "model_type": "glm5_next_text"}
    for d in ({"model_type": "glm5_next", "text_config": text}, {**text, "model_type": "glm5_next"}):
        ours = ModelConfig.from_hf_dict(d)
        ref = Glm5NextConfig(**{k: v for k, v in d.items() if k != "model_type"}).text_config
        for name in ("layer_types", "indexer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "linear_lower_bound", "index_kpool", "index_kpool_always_select_tail",
                     "hc_mult", "hc_eps", "hc_sinkhorn_iters", "swiglu_limit", "qk_rope_head_dim",
                     "max_position_embeddings", "n_shared_experts", "routed_scaling_factor", "rms_norm_eps",
                     "pad_token_id"):
            assert getattr(ours, name) == getattr(ref, name), name
        assert ours.indexer_types[-1] == "shared" and ours.linear_lower_bound == -5.0


def test_glm_5_3_flash_info_matches_the_published_size(capsys):
    """zai-org publishes GLM-5.3-Flash as 320B total / 18B active parameters (vision tower aside)."""
    assert main(["info", "--preset", "glm-5.3-flash", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert abs(r["total_params"] / 320e9 - 1) <= 0.01
    assert abs(r["active_params"] / 18e9 - 1) <= 0.05
    assert sum(r["breakdown"].values()) == r["total_params"]
    assert r["cache"]["bytes_per_sequence"] == 34 * (4 * 64 * 128 * 128 + 2 * 3 * 64 * 128 * 3)
    assert main(["info", "--preset", "glm-5.3-flash"]) == 0
    out = capsys.readouterr().out
    assert "KDA linear attention 64 heads x 128 (conv 4) in 34 layers" in out and "active / token" in out


def test_counts_match_a_real_model():
    cfg = ModelConfig.from_preset("tiny-glm5-next")
    r = parameter_report(cfg)
    model = Glm5NextForCausalLM(cfg)
    assert r["total_params"] == sum(p.numel() for p in model.parameters())
    kda = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("model.layers.0.self_attn",
                                                                              "model.layers.3.self_attn")))
    assert r["breakdown"]["linear_attn (KDA)"] == kda
