"""int4 weights (`quantized.quantize_int4`, `int4_kernels.h`): the packed layout, the quantiser's rule, and every
kernel that reads the codes in place against the fp32 product of the dequantised weight.

Tolerances: a decode product (`native.linear` with <= 8 rows, the SwiGLU experts) multiplies exact bf16(code - 8)
by the input's bf16 parts and scales each group's fp32 sum once, so in fp32 it equals the fp32 reference to 2e-5
(summation order); in bf16 the output's rounding dominates (2^-8 relative). A prefill product (`int4_matmul`)
multiplies the torch path's bf16-dequantised weights: against the fp32 reference of those weights, the bf16 output
rounding again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openglm.model import native
from openglm.model.native import KernelError, int4_matmul, kernel_weight, linear, swiglu, swiglu_ok
from openglm.model.quantized import QuantizedWeight, pack_int4, quantize_int4, unpack_int4


def _int4(*shape, group=32, dtype=torch.bfloat16, seed=0):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedWeight(*quantize_int4(w, group), dtype=dtype)


def _exact(w: QuantizedWeight) -> torch.Tensor:
    """The dequantised weight in fp32, unrounded: (code - 8) * scale."""
    return (unpack_int4(w.qdata).float() - 8) * w.scale.float().repeat_interleave(w.group, dim=-1)


def test_packing_puts_a_blocks_low_and_high_halves_in_one_byte():
    codes = torch.arange(96, dtype=torch.uint8).remainder(16).view(1, 96)  # 96 = one 64-block + a 32-block
    packed = pack_int4(codes)
    assert packed.shape == (1, 48)
    assert packed[0, 5] == codes[0, 5] | (codes[0, 37] << 4)  # 64-block: byte j = code j | code 32 + j
    assert packed[0, 32 + 3] == codes[0, 64 + 3] | (codes[0, 64 + 19] << 4)  # 32-block: byte j = code j | 16 + j
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(torch.zeros(2, 40, dtype=torch.uint8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantiser_keeps_each_groups_extreme_and_rounds_the_rest(group):
    w = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    w[0, :group] = 0  # an all-zero group: scale 0, dequantised to zeros
    q = QuantizedWeight(*quantize_int4(w, group), dtype=torch.float32)
    assert q.qdata.dtype == torch.uint8 and q.scale.dtype == torch.bfloat16 and q.scale.shape == (6, 256 // group)
    assert q.group == group and q.shape == (6, 256) and q.nbytes_stored() == 6 * 128 + 6 * (256 // group) * 2
    deq, g = q.dequantize().view(6, -1, group), w.view(6, -1, group)
    extreme = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    assert torch.allclose(deq.gather(-1, g.abs().argmax(-1, keepdim=True)), extreme, rtol=2 ** -8)
    step = q.scale.float().abs().unsqueeze(-1)
    # within half a step, except a value past 7.5 steps on the other side of the extreme: clamped to code 15
    bound = torch.maximum(step * 0.5, g.abs() - 7 * step) * (1 + 2 ** -7) + 1e-7
    assert ((deq - g).abs() <= bound).all()
    assert (deq[0, 0] == 0).all()
    with pytest.raises(ValueError, match="group 48 does not divide"):
        quantize_int4(w, 48)


def test_int4_views_stay_packed_and_misfits_are_refused():
    w = _int4(4, 8, 96)
    dense = w.dequantize()
    for view in (w[1], w[1:3], w.view(32, 96), torch.cat([w[0], w[3]]), torch.stack([w[0], w[2]]), w.detach()):
        assert isinstance(view, QuantizedWeight) and view.is_int4 and view.group == 32
    assert torch.equal(torch.stack([w[0], w[2]]).dequantize(), torch.stack([dense[0], dense[2]]))
    assert torch.equal(w.view(32, 96)[5:9].dequantize(), dense.view(32, 96)[5:9])
    t = w.transpose(1, 2)  # across the packed dimension: dequantised for the op
    assert not isinstance(t, QuantizedWeight) and torch.equal(t, dense.transpose(1, 2))
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedWeight(w.qdata, torch.ones(4, 8, 2, dtype=torch.bfloat16), torch.bfloat16)  # group 48


@pytest.mark.needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("group,width", [(32, 160), (64, 256), (128, 512)])  # 160: a last 32-code block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_decode_rows_equal_the_fp32_product(rows, group, width, dtype):
    w = _int4(72, width, group=group, dtype=dtype)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        got = linear(x, w)
    ref = x.float() @ _exact(w).t()
    assert got.dtype == dtype and got.shape == (rows, 72)
    tol = 2e-5 if dtype == torch.float32 else 2 ** -8
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.needs_native
@pytest.mark.parametrize("rows", [9, 37])
@pytest.mark.parametrize("group,width", [(32, 96), (128, 256)])
def test_int4_prefill_rows_equal_the_dequantised_product(rows, group, width):
    w = _int4(70, width, group=group)  # 70 outputs: a last block of two weight rows
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        got = linear(x, w)
    ref = x.float() @ w.dequantize().float().t()  # the torch path's bf16 weights
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
    assert (got.float() - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    out = torch.full((rows, 80), 7.0, dtype=torch.bfloat16)  # into a strided view: columns 70.. untouched
    int4_matmul(x, kernel_weight(w), 70, out[:, :70])
    assert torch.equal(out[:, :70], got) and (out[:, 70:] == 7).all()


@pytest.mark.needs_native
def test_int4_products_split_over_threads_give_the_same_bits():
    w = _int4(1024, 1024)  # 512 KiB of codes: above the size the kernels split over threads
    x1, x3, x40 = (torch.randn(n, 1024, generator=torch.Generator().manual_seed(n)).bfloat16() for n in (1, 3, 40))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append([linear(x, w) for x in (x1, x3, x40)])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_experts_decode_and_prefill_equal_the_fp32_swiglu(dtype):
    from openglm.model import ModelConfig, fast
    from openglm.model.moe import Experts

    cfg = ModelConfig.from_preset("tiny", hidden_size=64, moe_intermediate_size=64)
    experts = Experts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, 0, 0.05), torch.nn.init.normal_(experts.down_proj, 0, 0.05)
    experts = experts.to(dtype)
    for name in ("gate_up_proj", "down_proj"):
        q = QuantizedWeight(*quantize_int4(getattr(experts, name), 32), dtype=dtype)
        delattr(experts, name)
        experts.register_buffer(name, q, persistent=False)
    gu, dn = _exact(experts.gate_up_proj), _exact(experts.down_proj)

    def reference(xs, counts):
        out, start = [], 0
        for e, n in enumerate(counts):
            g, u = (xs[start:start + n].float() @ gu[e].t()).chunk(2, dim=-1)
            out.append((F.silu(g) * u) @ dn[e].t())
            start += n
        return torch.cat(out)

    g = torch.Generator().manual_seed(4)
    decode = [1, 0, 2, 1, 0, 0, 3, 1]
    assert swiglu_ok(torch.zeros(1, 64, dtype=dtype), experts.gate_up_proj, experts.down_proj)
    xs = torch.randn(sum(decode), 64, generator=g).to(dtype)
    got, ref = swiglu(xs, decode, experts.gate_up_proj, experts.down_proj).float(), reference(xs, decode)
    assert (got - ref).abs().max() <= (2e-5 if dtype == torch.float32 else 2 ** -8) * ref.abs().max()
    if dtype == torch.bfloat16:  # prefill-sized counts: int4_experts, bf16 rounding at each of its 3 steps
        prefill = [12, 0, 20, 9, 11, 0, 30, 10]
        xs = torch.randn(sum(prefill), 64, generator=g).bfloat16()
        with torch.inference_mode():
            got = fast.INFERENCE.experts(experts, xs, prefill).float()
        ref = reference(xs, prefill)
        assert (got - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.needs_native
def test_int4_kernels_refuse_sizes_and_groups_they_do_not_take():
    lib = native.decode_kernels()
    w = _int4(8, 64)
    x = torch.randn(1, 64)
    y = torch.empty(1, 8)
    args = lambda group, k=64: (native.ptr(x), 1, native.ptr(w.qdata), native.ptr(w.scale),  # noqa: E731
                                native.W_I4, group, 0, 8,
                                k, native.ptr(y))
    assert lib.rows_linear(*args(32)) == 0
    for group in (0, 16, 48, 256):  # not a group the kernels take, or not dividing 64
        assert lib.rows_linear(*args(group)) == native.KERNEL_BAD_ARGS
    assert lib.rows_linear(*args(32, k=48)) == native.KERNEL_BAD_ARGS  # a width not a multiple of 32
    xb = x.bfloat16()
    yb = torch.empty(1, 8, dtype=torch.bfloat16)
    assert lib.i4_matmul(native.ptr(xb), 1, 64, native.ptr(w.qdata), native.ptr(w.scale), 32, 8, 64,
                         native.ptr(yb), 1, 8) == 0
    for bad in (dict(group=64 + 32), dict(xs=32), dict(ys=4), dict(rows=0)):
        a = dict(rows=1, xs=64, group=32, ys=8) | bad
        assert lib.i4_matmul(native.ptr(xb), a["rows"], a["xs"], native.ptr(w.qdata), native.ptr(w.scale),
                             a["group"], 8, 64, native.ptr(yb), 1, a["ys"]) == native.KERNEL_BAD_ARGS
    with pytest.raises(KernelError):
        native.check(lib.set_kernel_threads(0), "set_kernel_threads")
    with pytest.raises(ValueError, match="does not fit the int4 weight"):
        int4_matmul(torch.randn(2, 32).bfloat16(), kernel_weight(w), 8)


def test_convert_takes_one_quantisation(tmp_path, capsys):
    from openglm.cli import main

    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--fp8", "--int4"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--fp8 and --int4 exclude each other" in err[0]
    assert not (tmp_path / "dst").exists()
