"""FP8 block-quantised checkpoints (the -FP8 releases' format): written by `openglm convert --fp8`, read by
dequantising on load. Reference: transformers' own FP8 dequantisation of the same files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from openglm.cli import main
from openglm.model import ModelConfig, load_model
from openglm.model.checkpoint import save_pretrained
from openglm.model.fp8 import Fp8Config, dequantize, quantize

TOL = 1e-4
BLOCK = (8, 8)  # divides every tiny width (transformers' dequantiser needs whole blocks)


def test_block_quantisation_error_is_bounded_and_shapes_need_not_divide():
    w = torch.randn(37, 21) * torch.logspace(-3, 1, 21)  # columns of very different scales
    q, s = quantize(w, (16, 8))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3) and s.dtype == torch.float32
    back = dequantize(q, s, (16, 8))
    block_max = s.repeat_interleave(16, 0)[:37].repeat_interleave(8, 1)[:, :21] * 448
    assert ((back - w).abs() <= block_max / 16).all()  # e4m3 keeps 3 mantissa bits: error <= 2^-4 of the block max
    assert (back - w).abs().max() > 0  # it is a real quantisation


@pytest.fixture
def fp8_ckpt(tmp_path, make_pair):
    cfg = ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=8)
    _, ours = make_pair(cfg)
    save_pretrained(ours, tmp_path / "fp8", quantization=Fp8Config(BLOCK))
    return tmp_path / "fp8", ours


def test_fp8_checkpoint_format(fp8_ckpt):
    path, _ = fp8_ckpt
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8],
                  "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate", "indexer.weights_proj",
                                             "eh_proj"]}
    t = load_file(str(path / "model.safetensors"))
    w = "model.layers.1.mlp.experts.5.gate_proj.weight"
    assert t[w].dtype == torch.float8_e4m3fn and t[w + "_scale_inv"].shape == (4, 8)
    assert t["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.weights_proj.weight", "model.norm.weight"):
        assert t[kept].dtype == torch.float32 and kept + "_scale_inv" not in t


def test_fp8_logits_match_the_dequantised_reference(fp8_ckpt, padded_batch):
    from transformers import FineGrainedFP8Config, GlmMoeDsaForCausalLM

    path, unquantised = fp8_ckpt
    ref = GlmMoeDsaForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                               attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_model(path)
    assert ours.dtype == torch.float32
    ids, mask, pos = padded_batch(256, [20, 13])
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask).logits
        before = unquantised(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (expected - got).abs()[real].max() <= TOL
    assert (before - got).abs()[real].max() > 1e-2  # the weights really went through e4m3


def test_convert_fp8_to_bf16_and_back_round_trips(fp8_ckpt, tmp_path):
    path, _ = fp8_ckpt
    assert main(["convert", str(path), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    bf16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert not any(k.endswith("_scale_inv") for k in bf16)
    assert {t.dtype for k, t in bf16.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "bf16")(ids).logits, load_model(path, dtype="bfloat16")(ids).logits)
    # FP8 -> fp32 -> FP8 gives back the same e4m3 weights and block scales
    assert main(["convert", str(path), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert main(["convert", str(tmp_path / "fp32"), str(tmp_path / "again"), "--fp8", "--fp8-block", "8,8"]) == 0
    first, again = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys()
    for k in first:
        assert torch.equal(first[k].float(), again[k].float()), k


def test_modules_to_not_convert_are_honoured(tmp_path):
    model = load_model_from_preset()
    save_pretrained(model, tmp_path / "c", quantization=Fp8Config(BLOCK, ["lm_head", "model.embed_tokens",
                                                                          "mlp.gate", "self_attn"]))
    t = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert t["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float32
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        loaded = load_model(tmp_path / "c")
        assert torch.equal(loaded.model.layers[0].self_attn.q_a_proj.weight,
                           model.model.layers[0].self_attn.q_a_proj.weight)
        assert loaded(ids).logits.isfinite().all()


def test_convert_rejects_a_bad_block_in_one_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--fp8", "--fp8-block", "0,8"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def load_model_from_preset():
    from openglm.model import GlmMoeDsaForCausalLM

    torch.manual_seed(0)
    return GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")).eval()
