"""Hugging Face checkpoints in both directions, sharding, atomic save (bad checkpoints: test_loader_errors.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import openglm
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model import checkpoint as ckpt
from openglm.model import save as saver
from openglm.model.errors import TokenIdError

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
    save_pretrained(ours, tmp_path / "ours")
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
    save_pretrained(m, tmp_path / "c", max_shard_size=20_000)
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
    save_pretrained(a, tmp_path / "c")
    calls = []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kwargs)

    monkeypatch.setattr(saver, "save_file", crash)
    with pytest.raises(OSError):
        save_pretrained(b, tmp_path / "c", max_shard_size=20_000)
    loaded = load_model(tmp_path / "c")  # still the complete old checkpoint
    assert torch.equal(loaded.lm_head.weight, a.lm_head.weight)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temp directory left behind
    calls.clear()
    with pytest.raises(OSError):
        save_pretrained(b, tmp_path / "new", max_shard_size=20_000)
    assert not (tmp_path / "new").exists()


def test_token_ids_outside_vocabulary():
    m = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny"))
    v = m.config.vocab_size
    with pytest.raises(TokenIdError, match=str(v)):
        m(torch.tensor([[1, v]]))
    with pytest.raises(TokenIdError, match="-1"):
        m(torch.tensor([[-1, 2]]))
