"""QuantizedWeight: an int8 / fp8 weight that stands in for a float one. Views that keep whole rows stay
quantised, other ops see the dequantised weight, and the decode kernels read int8 values in place with the
same result as the dequantised matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openglm.engine.quant import quantize_tensor
from openglm.model.native import heads_linear, linear, swiglu, swiglu_ok
from openglm.model.quantized import QuantizedWeight


def _weight(*shape, dtype=torch.bfloat16, kind="int8", seed=0):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight(*quantize_tensor(w, kind), dtype=dtype)


def test_views_that_keep_rows_stay_quantised_and_others_dequantise():
    w = _weight(4, 6, 32)
    dense = w.dequantize()
    for view in (w[1], w[1:3], w.view(24, 32), w[2, 1:4], torch.cat([w[0], w[3]], 0), w.detach()):
        assert isinstance(view, QuantizedWeight) and view.qdata.dtype == torch.int8
    assert torch.equal(w[1:3].dequantize(), dense[1:3])
    assert torch.equal(torch.cat([w[0], w[3]]).dequantize(), torch.cat([dense[0], dense[3]]))
    t = w.transpose(1, 2)  # splits each row's scale: dequantised for the op
    assert not isinstance(t, QuantizedWeight) and torch.equal(t, dense.transpose(1, 2))
    assert w.dtype == torch.bfloat16 and w.shape == (4, 6, 32) and w.nbytes_stored() == 4 * 6 * 32 + 4 * 6 * 4
    with pytest.raises(ValueError, match="one fp32 scale per row"):
        QuantizedWeight(w.qdata, torch.ones(4, 6), torch.bfloat16)


def test_views_work_under_inference_mode():
    """The engine runs the model under inference_mode on weights made outside it: a view (kept quantised or
    of the dequantised copy) must not come back as an inference tensor, which autograd's view tracking rejects."""
    w = _weight(4, 6, 32)
    with torch.inference_mode():
        kept, split = w.view(24, 32)[2:5], w[1].transpose(0, 1).contiguous()
    assert isinstance(kept, QuantizedWeight) and torch.equal(kept.dequantize(), w.dequantize().view(24, 32)[2:5])
    assert torch.equal(split, w.dequantize()[1].t())


@pytest.mark.needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_linear_equals_the_dequantised_linear(rows, dtype):
    w = _weight(72, 64, dtype=dtype)  # 72 rows: the 4-row blocks and the remainder loop
    x = torch.randn(rows, 64).to(dtype)
    with torch.no_grad():
        got = linear(x, w)
    ref = F.linear(x.float(), w.qdata.float() * w.scale)
    assert got.dtype == dtype and got.shape == (rows, 72)
    assert (got.float() - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 8e-3) * ref.abs().max()


def test_int8_linear_over_many_bf16_rows_reads_int8_weights():
    """A prefill's bf16 rows take ATen's weight-only int8 matmul (the scale rounded to bf16)."""
    w = _weight(40, 64)
    x = torch.randn(2, 20, 64).bfloat16()
    with torch.no_grad():
        got = linear(x, w)
    ref = F.linear(x.float(), w.qdata.float() * w.scale)
    assert got.shape == (2, 20, 40) and (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.needs_native
def test_int8_heads_linear_reads_per_head_scales():
    w = _weight(3, 48, 64)[:, 16:]  # a per-head slice of rows, as MLA's W_uv view of kv_b_proj
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        got = heads_linear(x, QuantizedWeight(w.qdata, w.scale, torch.float32))
    ref = torch.einsum("rhk,hmk->rhm", x, w.qdata.float() * w.scale)
    assert got is not None and (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_expert_kernel_equals_the_dequantised_swiglu(dtype):
    gate_up, down = _weight(5, 64, 32, dtype=dtype, seed=1), _weight(5, 32, 32, dtype=dtype, seed=2)
    counts = [2, 0, 1, 8, 1]
    xs = torch.randn(sum(counts), 32).to(dtype)
    assert swiglu_ok(xs, gate_up, down)
    with torch.no_grad():
        got = swiglu(xs, counts, gate_up, down).float()
    ref, start = [], 0
    for e, n in enumerate(counts):
        g, u = F.linear(xs[start:start + n].float(), gate_up.qdata[e].float() * gate_up.scale[e]).chunk(2, -1)
        ref.append(F.linear(F.silu(g) * u, down.qdata[e].float() * down.scale[e]))
        start += n
    ref = torch.cat(ref)
    assert (got - ref).abs().max() <= (1e-5 if dtype == torch.float32 else 8e-3) * ref.abs().max()
    fp8 = _weight(5, 64, 32, dtype=dtype, kind="fp8")
    assert not swiglu_ok(xs, fp8, down)  # fp8: the dequantising matmul path
