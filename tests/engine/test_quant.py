"""Weight-only int8 / fp8 quantisation: smaller weights, logits close to fp32, engine still runs."""

import pytest
import torch

from openglm.engine import LLM, SamplingParams
from openglm.engine.quant import model_weight_bytes, quantize_model, quantize_tensor
from openglm.model.quantized import QuantizedWeight


@pytest.mark.parametrize("kind,tol", [("int8", 0.01), ("fp8", 0.07)])
def test_quantize_tensor_roundtrip_error_is_bounded(kind, tol):
    w = torch.randn(64, 128)
    q, scale = quantize_tensor(w, kind)
    assert q.element_size() == 1 and scale.shape == (64, 1)
    err = (QuantizedWeight(q, scale, torch.float32).dequantize() - w).abs() / w.abs().amax(-1, keepdim=True)
    assert err.max() < tol


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_model_is_smaller_and_close(tiny_checkpoint, kind):
    from openglm.model import load_model

    ref = load_model(str(tiny_checkpoint), dtype=torch.float32)
    model = load_model(str(tiny_checkpoint), dtype=torch.float32)
    before = model_weight_bytes(model)
    report = quantize_model(model, kind)
    after = model_weight_bytes(model)
    assert report["weight_bytes_after"] < 0.3 * report["weight_bytes_before"]
    assert after < 0.6 * before  # embeddings and norms stay fp32
    head = model.lm_head.weight
    assert isinstance(head, QuantizedWeight) and head.qdata.element_size() == 1 and head.dtype == torch.float32
    assert not any(isinstance(p, QuantizedWeight) for p in model.parameters())  # held as buffers, not trained
    ids = torch.randint(10, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.99
    assert model.lm_head.weight is head and model_weight_bytes(model) == after  # no dequantised copy kept


def test_engine_serves_quantized_weights(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=32, quantization="int8")
    out = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_checkpoint), quantization="int3")


def test_int8_decode_step_matches_the_dequantised_model(tiny_checkpoint):
    """A decode-sized forward over int8 weights (the kernels read them in place) gives the logits of the same
    model with the dequantised weights as ordinary parameters, in fp32 and bf16."""
    from openglm.model import load_model

    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 0.03)]:
        model = load_model(str(tiny_checkpoint), dtype=dtype)
        quantize_model(model, "int8")
        ref = load_model(str(tiny_checkpoint), dtype=dtype)
        quantized = {n: b for n, b in model.named_buffers() if isinstance(b, QuantizedWeight)}
        assert any(".experts." in n for n in quantized) and "lm_head.weight" in quantized
        ref.load_state_dict({n: b.dequantize() for n, b in quantized.items()}, strict=False)
        ids = torch.randint(10, 380, (2, 1), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a, b = model(ids).logits.float(), ref(ids).logits.float()
        assert (a - b).abs().max() <= tol * b.abs().max()


def test_engine_greedy_equals_the_models_own_greedy_under_int4(tiny_checkpoint, tmp_path):
    """`openglm convert --int4` writes the tiny checkpoint as int4; the engine serving it (prefill, native decode
    steps, paged cache) picks the tokens the model itself picks by argmax over full forwards of the same weights."""
    import json
    import shutil

    from openglm.cli import main
    from openglm.model import load_model

    dest = tmp_path / "int4"
    assert main(["convert", str(tiny_checkpoint), str(dest), "--int4", "--dtype", "bfloat16"]) == 0
    for f in tiny_checkpoint.iterdir():  # the tokenizer files (convert writes the weights and config)
        if f.is_file() and not (dest / f.name).exists():
            shutil.copy(f, dest / f.name)
    assert json.loads((dest / "config.json").read_text())["quantization_config"]["quant_method"] == "openglm_int4"
    model = load_model(str(dest), dtype=torch.float32)  # int4 codes, fp32 activations: the engine's default
    experts = model.model.layers[-1].mlp.experts.gate_up_proj
    assert isinstance(experts, QuantizedWeight) and experts.is_int4 and model.lm_head.weight.is_int4
    llm = LLM(str(dest), num_kv_blocks=32, dtype="float32")
    prompt = llm.tokenizer.encode("def main():\n    return")
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(10):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got == ids[0, len(prompt):].tolist()
