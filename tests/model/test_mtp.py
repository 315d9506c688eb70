"""Next-n (MTP) layers: `model.layers.{num_hidden_layers + i}.*` load, save and round-trip; only the declared
`num_nextn_predict_layers` layers may follow the decoder layers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model.errors import MissingTensorError, UnexpectedTensorError


@pytest.fixture(params=["tiny", "tiny-glm4-moe", "tiny-glm4-moe-lite"])
def mtp_model(request):
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset(request.param, num_nextn_predict_layers=1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # norms differ from 1, so a dropped tensor would show
    return model


def test_next_n_tensors_round_trip(mtp_model, tmp_path):
    n = mtp_model.config.num_hidden_layers
    mtp_model.mtp_extra[f"model.layers.{n}.shared_head.head.weight"] = torch.randn(256, 64)
    save_pretrained(mtp_model, tmp_path / "c")
    on_disk = load_file(str(tmp_path / "c" / "model.safetensors"))
    mtp = {k: v for k, v in on_disk.items() if k.startswith(f"model.layers.{n}.")}
    # the DeepSeek-V3-style next-n block, under the layer index after the decoder layers
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "input_layernorm.weight", "mlp.gate.weight", "mlp.experts.7.down_proj.weight",
                 "shared_head.head.weight"):
        assert f"model.layers.{n}.{name}" in mtp, name
    assert json.loads((tmp_path / "c" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    loaded = load_model(tmp_path / "c")
    assert loaded.config.num_nextn_predict_layers == 1
    mine, theirs = mtp_model.state_dict(), loaded.state_dict()
    assert [k for k in mine if ".mtp_layers." in k] == [k for k in theirs if ".mtp_layers." in k]
    assert all(torch.equal(mine[k], theirs[k]) for k in mine if ".mtp_layers." in k)
    assert torch.equal(loaded.mtp_extra[f"model.layers.{n}.shared_head.head.weight"],
                       mtp_model.mtp_extra[f"model.layers.{n}.shared_head.head.weight"])
    save_pretrained(loaded, tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert again.keys() == on_disk.keys() and all(torch.equal(again[k], on_disk[k]) for k in on_disk)


def test_next_n_layer_does_not_change_the_logits(mtp_model):
    plain = GlmMoeDsaForCausalLM(mtp_model.config.replace(num_nextn_predict_layers=0)).eval()
    plain.load_state_dict({k: v for k, v in mtp_model.state_dict().items() if ".mtp_layers." not in k})
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, mtp_model(ids).logits)


def test_checkpoint_without_its_declared_next_n_layer_loads_without_it(tmp_path):
    """transformers drops MTP weights on save; such a checkpoint loads as a model without next-n layers."""
    save_pretrained(GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")), tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert load_model(tmp_path / "c").config.num_nextn_predict_layers == 0


def test_incomplete_next_n_layer_names_the_missing_tensor(tmp_path):
    save_pretrained(GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", num_nextn_predict_layers=1)), tmp_path / "c")
    f = tmp_path / "c" / "model.safetensors"
    tensors = load_file(str(f))
    tensors.pop("model.layers.3.eh_proj.weight")
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load_model(tmp_path / "c")


def test_layers_beyond_the_declared_ones_are_an_error(tmp_path):
    """A config that declares fewer layers than the checkpoint would load a truncated model: refused."""
    save_pretrained(GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")), tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg.update(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], indexer_types=["full", "shared"],
               index_topk_pattern="FS")
    cfg["openglm"]["attention_kinds"] = ["dsa", "dsa"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnexpectedTensorError, match=r"tensor 'model\.layers\.2\..*' belongs to layer 2"):
        load_model(tmp_path / "c")
