"""Hugging Face checkpoints in both directions, sharding, atomic save, and bad-input errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import openglm
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model
from openglm.model import checkpoint as ckpt
from openglm.model.errors import (CheckpointTooLargeError, ConfigError, MissingShardError, MissingTensorError,
                                  ShapeMismatchError, TokenIdError, UnexpectedTensorError, UnknownModelTypeError)

TOL = 1e-4


def _logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits


def test_transformers_save_then_openglm_load(tmp_path, tiny_cfg, make_pair, padded_batch):
    hf, _ = make_pair(tiny_cfg)
    hf.save_pretrained(tmp_path / "hf")
    ours = openglm.load_model(tmp_path / "hf")
    ids, mask, pos = padded_batch(tiny_cfg.vocab_size, [22, 15])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert (ref - _logits(ours, ids, mask)).abs()[mask.bool()].max() <= TOL


def test_openglm_save_then_transformers_load(tmp_path, tiny_cfg, make_pair, padded_batch):
    from transformers import GlmMoeDsaForCausalLM as HFModel

    _, ours = make_pair(tiny_cfg, seed=3)
    ours.save_pretrained(tmp_path / "ours")
    on_disk = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in on_disk  # transformers' on-disk names
    assert not any(k.endswith("gate_up_proj") for k in on_disk)
    hf = HFModel.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    ids, mask, pos = padded_batch(tiny_cfg.vocab_size, [22, 15], seed=3)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert (ref - _logits(ours, ids, mask)).abs()[mask.bool()].max() <= TOL


def test_sharded_roundtrip_keeps_options_and_dtype(tmp_path):
    cfg = ModelConfig.from_preset("tiny", router="softmax", capacity_factor=1.5, z_loss_coef=1e-3)
    m = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16).eval()
    m.save_pretrained(tmp_path / "c", max_shard_size=20_000)
    index = json.loads((tmp_path / "c" / ckpt.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_model(tmp_path / "c")
    assert loaded.config == cfg and loaded.dtype == torch.bfloat16
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert torch.equal(_logits(m, ids, None), _logits(loaded, ids, None))
    assert load_model(tmp_path / "c", dtype="float32").dtype == torch.float32


def test_overwrite_is_atomic(tmp_path, monkeypatch):
    cfg = ModelConfig.from_preset("tiny")
    a, b = GlmMoeDsaForCausalLM(cfg), GlmMoeDsaForCausalLM(cfg)
    a.save_pretrained(tmp_path / "c")
    calls = []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", crash)
    with pytest.raises(OSError):
        b.save_pretrained(tmp_path / "c", max_shard_size=20_000)
    loaded = load_model(tmp_path / "c")  # still the complete old checkpoint
    assert torch.equal(loaded.lm_head.weight, a.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temp directory left behind
    calls.clear()
    with pytest.raises(OSError):
        b.save_pretrained(tmp_path / "new", max_shard_size=20_000)
    assert not (tmp_path / "new").exists()


@pytest.fixture
def saved(tmp_path):
    GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path / "c", max_shard_size=20_000)
    return tmp_path / "c"


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_shard(path, fn):
    index = json.loads((path / ckpt.INDEX).read_text())
    shard = path / index["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_unknown_model_type(saved):
    _edit_config(saved, model_type="llama")
    with pytest.raises(UnknownModelTypeError, match="llama"):
        load_model(saved)


def test_config_value_that_cannot_be_honoured(saved):
    _edit_config(saved, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_model(saved)
    _edit_config(saved, num_key_value_heads=4, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(ConfigError, match="longrope"):
        load_model(saved)


def test_missing_tensor(saved):
    _edit_shard(saved, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(saved)


def test_extra_tensor(saved):
    _edit_shard(saved, lambda t: t.update({"model.layers.1.mlp.bogus.weight": torch.zeros(2)}))
    with pytest.raises(UnexpectedTensorError, match="bogus"):
        load_model(saved)


def test_shape_mismatch(saved):
    _edit_shard(saved, lambda t: t.update({"model.layers.1.mlp.experts.3.up_proj.weight": torch.zeros(5, 64)}))
    with pytest.raises(ShapeMismatchError, match=r"experts\.3\.up_proj.*\(5, 64\)"):
        load_model(saved)


def test_missing_shard(saved):
    index = json.loads((saved / ckpt.INDEX).read_text())
    victim = saved / sorted(set(index["weight_map"].values()))[-1]
    victim.unlink()
    with pytest.raises(MissingShardError, match=victim.name):
        load_model(saved)


def test_missing_config(tmp_path):
    with pytest.raises(MissingShardError, match="config.json"):
        load_model(tmp_path)


def test_too_large_is_refused_before_loading(saved):
    with pytest.raises(CheckpointTooLargeError, match="GiB"):
        load_model(saved, max_memory=1000)


def test_token_ids_outside_vocabulary():
    m = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny"))
    with pytest.raises(TokenIdError, match="256"):
        m(torch.tensor([[1, 256]]))
    with pytest.raises(TokenIdError, match="-1"):
        m(torch.tensor([[-1, 2]]))
