"""Weight-only int8 / fp8 quantisation: smaller weights, logits close to fp32, engine still runs."""

import pytest
import torch

from openglm.engine import LLM, SamplingParams
from openglm.engine.quant import dequantize_tensor, model_weight_bytes, quantize_model, quantize_tensor


@pytest.mark.parametrize("kind,tol", [("int8", 0.01), ("fp8", 0.07)])
def test_quantize_tensor_roundtrip_error_is_bounded(kind, tol):
    w = torch.randn(64, 128)
    q, scale = quantize_tensor(w, kind)
    assert q.element_size() == 1 and scale.shape == (64, 1)
    err = (dequantize_tensor(q, scale, torch.float32) - w).abs() / w.abs().amax(-1, keepdim=True)
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
    assert model.lm_head.weight is None and model.lm_head.weight_q.dtype != torch.float32
    ids = torch.randint(10, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.99
    assert model.lm_head.weight is None  # dequantised weights are dropped again after each call


def test_engine_serves_quantized_weights(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=32, quantization="int8")
    out = llm.generate("def f():", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_checkpoint), quantization="int4")


def test_int8_lm_head_reads_int8_weights_and_matches_the_dequantised_linear(tiny_checkpoint):
    """In bf16 the int8 LM head runs ATen's weight-only int8 matmul (no dequantised copy): same logits as the
    dequantised weight up to bf16 rounding (the scale is rounded to bf16); fp32 dequantises for the call."""
    from openglm.model import load_model

    for dtype, tol in [(torch.bfloat16, 0.02), (torch.float32, 1e-5)]:
        model = load_model(str(tiny_checkpoint), dtype=dtype)
        quantize_model(model, "int8")
        head = model.lm_head
        x = torch.randn(3, 1, head.in_features, dtype=dtype)
        with torch.no_grad():
            out = head(x)
            ref = torch.nn.functional.linear(x.float(), dequantize_tensor(head.weight_q, head.weight_scale, torch.float32))
        assert out.dtype == dtype and out.shape == (3, 1, head.out_features) and head.weight is None
        assert (out.float() - ref).abs().max() <= tol * ref.abs().max()
