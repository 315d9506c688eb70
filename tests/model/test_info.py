"""`openglm info`: the glm-5 parameter table (built on the meta device)."""

from __future__ import annotations

import json

from openglm.cli import main
from openglm.model import ModelConfig
from openglm.model.params import parameter_report


def test_glm5_info_json(capsys):
    assert main(["info", "--preset", "glm-5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert abs(r["total_params"] / 743.9e9 - 1) <= 0.01
    assert abs(r["active_params"] / 40e9 - 1) <= 0.05
    assert sum(r["breakdown"].values()) == r["total_params"]
    assert r["weight_memory_gib"]["bf16"] == r["total_params"] * 2 / 2**30


def test_counts_match_a_real_model():
    cfg = ModelConfig.from_preset("tiny")
    from openglm.model import GlmMoeDsaForCausalLM

    r = parameter_report(cfg)
    assert r["total_params"] == sum(p.numel() for p in GlmMoeDsaForCausalLM(cfg).parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert r["total_params"] - r["active_params"] == 2 * (8 - 2) * per_expert


def test_text_table(capsys):
    assert main(["info", "--preset", "small", "--set", "num_hidden_layers=2",
                 "--set", 'indexer_types=["full","shared"]']) == 0
    out = capsys.readouterr().out
    assert "layers 2" in out and "active / token" in out and "routed_experts" in out


def test_bad_set_options_print_one_error_line(capsys):
    assert main(["info", "--preset", "tiny", "--set", "num_hidden_layers"]) == 1
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    assert main(["info", "--preset", "tiny", "--set", "no_such_field=1"]) == 1
    assert "no_such_field" in capsys.readouterr().err
