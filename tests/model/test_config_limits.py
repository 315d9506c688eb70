"""Absurd configs fail fast: sizes are range-checked, and checked against each other and against the weights' headers,
before anything is built per layer, expert or list element; a MemoryError while loading is one line.

Each attack is a config.json an attacker (or a typo) can hand to `openglm serve` / `generate` / `info`. Before, a
billion layers gave no answer after 120 s, 10^8 experts a MemoryError traceback after 37 s, a 10^8-character
index_topk_pattern took 98 s to be refused, and attn_query_chunk: -4 or rope_theta: 1e308 loaded. The time bound
below is generous for a loaded CI machine; each refusal takes milliseconds.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from openglm.cli import main
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model.config import LIMITS, MAX_LAYERS
from openglm.model.errors import CheckpointTooLargeError, ConfigError

FAST_S = 2.0


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    save_pretrained(GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")), tmp_path / "c")
    return tmp_path / "c"


def hostile(path, drop: tuple[str, ...] = (), **changes):
    """config.json as an attacker writes it: the keys `drop` left out (the per-layer lists: then nothing caps the
    layer count), then `changes` (keys under `openglm` where openglm keeps them)."""
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
        cfg["openglm"].pop(key, None)
    for key, value in changes.items():
        (cfg["openglm"] if key in cfg["openglm"] else cfg)[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


LISTS = ("mlp_layer_types", "indexer_types", "index_topk_pattern", "attention_kinds")


def refused(path, key: str, capsys) -> str:
    """The one-line refusal of `openglm info --checkpoint` and of load_model, each fast, both naming `key`."""
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=key) as err:
        load_model(path)
    assert time.perf_counter() - t0 < FAST_S
    t0 = time.perf_counter()
    assert main(["info", "--checkpoint", str(path)]) == 1
    assert time.perf_counter() - t0 < FAST_S
    line = capsys.readouterr().err
    assert len(line.strip().splitlines()) == 1 and key in line and "Traceback" not in line
    return str(err.value)


@pytest.mark.parametrize("layers", [10**9, 2 * 10**6])
def test_config_with_a_billion_layers_is_refused_at_once(ckpt, capsys, layers):
    hostile(ckpt, LISTS, num_hidden_layers=layers)
    assert f"num_hidden_layers={layers} must be in [1, {MAX_LAYERS}]" in refused(ckpt, "num_hidden_layers", capsys)


def test_config_with_a_hundred_million_experts_is_refused_at_once(ckpt, capsys):
    hostile(ckpt, n_routed_experts=10**8)
    message = refused(ckpt, "n_routed_experts", capsys)
    assert f"at most {LIMITS['n_routed_experts']:,}" in message


def test_config_with_an_index_topk_pattern_of_1e8_characters_is_refused_at_once(ckpt, capsys):
    hostile(ckpt, ("indexer_types",), index_topk_pattern="F" * 10**8)
    assert "the value of 'index_topk_pattern' makes the file" in refused(ckpt, "index_topk_pattern", capsys)
    # the same pattern handed over as a dict (no file to cap): its length is checked before its characters
    d = json.loads((ckpt / "config.json").read_text())
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="index_topk_pattern has 100,000,000 characters, num_hidden_layers is 3"):
        ModelConfig.from_hf_dict(d)
    assert time.perf_counter() - t0 < FAST_S


def test_config_with_attn_query_chunk_minus_4_is_refused(ckpt, capsys):
    hostile(ckpt, attn_query_chunk=-4)
    assert "attn_query_chunk=-4 must be >= 1" in refused(ckpt, "attn_query_chunk", capsys)


def test_config_with_rope_theta_1e308_is_refused(ckpt, capsys):
    hostile(ckpt, ("rope_parameters",), rope_theta=1e308)
    assert "rope_theta=1e+308 must be a number in (0, 3.4e+38]" in refused(ckpt, "rope_theta", capsys)


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 500}, r"num_hidden_layers=500, but the weights hold layers 0\.\.2"),
    ({"n_routed_experts": 64}, r"n_routed_experts=64, but layer 1's weights hold 8 experts"),
    ({"vocab_size": 100_000}, r"vocab_size=100000, hidden_size=64, but model\.embed_tokens\.weight is \[384, 64\]"),
])
def test_config_sizes_are_checked_against_the_weights_header(ckpt, changes, message):
    """Within the limits but more than the weights hold: refused from the headers, before a model is built."""
    hostile(ckpt, LISTS if "num_hidden_layers" in changes else (), **changes)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        load_model(ckpt)
    assert time.perf_counter() - t0 < FAST_S


def test_direct_configs_check_sizes_before_building_lists():
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"num_hidden_layers=1000000000 is beyond what openglm accepts \(at most"):
        ModelConfig.from_preset("tiny", num_hidden_layers=10**9, indexer_types=None)
    with pytest.raises(ConfigError, match=r"indexer_types has 100000000 entries, num_hidden_layers is 3"):
        ModelConfig.from_preset("tiny", indexer_types=["full"] * 10**8)
    assert time.perf_counter() - t0 < FAST_S
    with pytest.raises(ConfigError, match=r"num_hidden_layers=1020 \+ num_nextn_predict_layers=8"):
        ModelConfig.from_preset("tiny", num_hidden_layers=1020, num_nextn_predict_layers=8, indexer_types=None)


def python_out_of_memory(*args, **kwargs):
    raise MemoryError


def torch_out_of_memory(*args, **kwargs):
    torch.empty(1 << 58, dtype=torch.uint8)  # the allocator refuses at once: a RuntimeError, not a MemoryError


@pytest.mark.parametrize("exhausted", [python_out_of_memory, torch_out_of_memory])
def test_a_memory_error_while_loading_is_one_line(ckpt, monkeypatch, capsys, exhausted):
    from openglm.model import checkpoint

    monkeypatch.setattr(checkpoint, "_fill", exhausted)
    with pytest.raises(CheckpointTooLargeError, match="ran out of memory loading checkpoint .*smaller dtype"):
        load_model(ckpt)
    assert main(["convert", str(ckpt), str(ckpt.parent / "out")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ran out of memory loading checkpoint" in err


def test_other_runtime_errors_while_loading_keep_their_type(ckpt, monkeypatch):
    from openglm.model import checkpoint

    def bug(*args, **kwargs):
        raise RuntimeError("shape mismatch in a kernel")

    monkeypatch.setattr(checkpoint, "_fill", bug)
    with pytest.raises(RuntimeError, match="shape mismatch in a kernel"):
        load_model(ckpt)
