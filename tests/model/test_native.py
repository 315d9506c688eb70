"""The native kernels check their inputs: the Python wrappers refuse shapes that do not fit (never a read past a
buffer), every exported C function refuses sizes outside its limits with an error code and writes nothing, every
error code becomes an exception, and a run under AddressSanitizer finds no out-of-bounds access at tiny shapes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from openglm.engine.quant import quantize_tensor
from openglm.model import native
from openglm.model.native import KERNEL_BAD_ARGS, KERNEL_NO_MEMORY, KernelError, check, ptr
from openglm.model.quantized import QuantizedWeight

ROOT = Path(__file__).resolve().parents[2]


def test_limits_come_from_the_c_and_errors_become_exceptions():
    limits = native.decode_limits()
    if native.decode_kernels() is not None:
        assert (limits.max_rows, limits.heads_max_width, limits.step_max_width) == (8, 1024, 65536)
        assert native.max_rows() == limits.max_rows
    else:
        assert native.max_rows() == 0
    assert check(3, "k") == 3
    with pytest.raises(KernelError, match="refused its arguments"):
        check(KERNEL_BAD_ARGS, "k")
    with pytest.raises(MemoryError, match="out of memory"):
        check(KERNEL_NO_MEMORY, "k")


@pytest.mark.parametrize("rows", [1, 3, 40])  # the kernel's rows and the matmul paths past them
def test_linear_refuses_a_weight_whose_inner_width_is_not_the_inputs(rows):
    x = torch.randn(rows, 64)
    for w in (torch.randn(32, 48), QuantizedWeight(*quantize_tensor(torch.randn(32, 48), "int8"), torch.float32)):
        with torch.no_grad(), pytest.raises(ValueError, match="inner width"):
            native.linear(x, w)
    with torch.no_grad():  # a weight of the input's width runs
        assert native.linear(x, torch.randn(48, 64)).shape == (rows, 48)


def test_heads_linear_refuses_weights_of_other_heads_or_widths():
    x = torch.randn(2, 3, 64)
    for w in (torch.randn(2, 32, 64), torch.randn(3, 32, 48)):
        with torch.no_grad(), pytest.raises(ValueError, match="does not take input"):
            native.heads_linear(x, w)


def test_swiglu_ok_checks_both_weight_shapes_and_swiglu_refuses_counts_that_do_not_fit():
    H, inter = 32, 16
    xs = torch.randn(3, H)
    gate_up, down = torch.randn(4, 2 * inter, H), torch.randn(4, H, inter)
    fits = native.decode_kernels() is not None
    assert native.swiglu_ok(xs, gate_up, down) == fits
    assert not native.swiglu_ok(xs, torch.randn(4, 2 * inter + 16, H), down)  # gate_up rows are not 2 x down's width
    assert not native.swiglu_ok(xs, torch.randn(4, 2 * inter, H + 16), down)  # gate_up width is not down's rows
    assert not native.swiglu_ok(xs, torch.randn(5, 2 * inter, H), down)  # another number of experts
    assert not native.swiglu_ok(torch.randn(3, H + 16), gate_up, down)  # rows of another width
    if fits:
        with torch.no_grad(), pytest.raises(ValueError, match="do not fit"):
            native.swiglu(xs, [1, 1, 1], gate_up, down)  # 3 counts for 4 weight sets
        with torch.no_grad(), pytest.raises(ValueError, match="do not fit"):
            native.swiglu(xs, [1, 1, 1, 1], gate_up, down)  # 4 rows counted, 3 given


@pytest.mark.needs_native
def test_decode_kernels_refuse_sizes_outside_their_limits_and_write_nothing():
    lib, limits = native.decode_kernels(), native.decode_limits()
    n = limits.max_rows + 1
    x, w = torch.randn(n, 64), torch.randn(32, 64)
    out = torch.full((n, 32), 7.0)
    assert lib.rows_linear(ptr(x), n, ptr(w), None, native.W_F32, 0, 0, 32, 64, ptr(out)) == KERNEL_BAD_ARGS
    assert lib.rows_linear(ptr(x), 2, ptr(w), None, native.W_F32, 0, 0, 32, 24, ptr(out)) == KERNEL_BAD_ARGS  # k % 16
    assert lib.rows_linear(ptr(x), 2, ptr(w), None, native.W_I8, 0, 0, 32, 64, ptr(out)) == KERNEL_BAD_ARGS  # no scale
    assert lib.rows_linear(ptr(x), 2, ptr(w), None, 7, 0, 0, 32, 64, ptr(out)) == KERNEL_BAD_ARGS  # no such type
    wide = limits.heads_max_width + 16
    assert lib.heads_linear(ptr(x), 2, 1, ptr(w), None, native.W_F32, 0, 0, 0, wide, 64, ptr(out)) == KERNEL_BAD_ARGS
    assert lib.heads_linear(ptr(x), 2, 2, ptr(w), None, native.W_F32, 0, 16, 0, 32, 64, ptr(out)) == KERNEL_BAD_ARGS
    counts = torch.tensor([1, n], dtype=torch.int64)
    gu, dn, work = torch.randn(2, 32, 64), torch.randn(2, 64, 16), torch.empty(n * 48)
    assert lib.experts_swiglu(ptr(x), ptr(counts), 2, ptr(gu), ptr(dn), None, None, native.W_F32, 0, 64, 16, ptr(out),
                              ptr(work)) == KERNEL_BAD_ARGS
    b16 = torch.randn(2, 8).bfloat16()
    assert lib.rms_norm_bf16(ptr(b16), 2, 8, ptr(b16), 1e-6, ptr(b16)) == KERNEL_BAD_ARGS  # dim % 16
    assert lib.path_selections(2) == KERNEL_BAD_ARGS
    assert torch.equal(out, torch.full((n, 32), 7.0))  # nothing written


@pytest.mark.needs_native
def test_dsa_kernels_refuse_slots_and_sizes_outside_their_buffers():
    lib = native.dsa_kernels()
    idx = torch.tensor([[0, 5], [1, -1]])  # slot 5 of 4 keys
    key_start, pair_q = torch.full((5,), -3, dtype=torch.int64), torch.empty(4, dtype=torch.int32)
    assert lib.dsa_pairs_by_key(ptr(idx), 2, 2, 4, ptr(key_start), ptr(pair_q)) == KERNEL_BAD_ARGS
    assert torch.equal(key_start, torch.full((5,), -3))
    idx[0, 1] = 3
    assert lib.dsa_pairs_by_key(ptr(idx), 2, 2, 4, ptr(key_start), ptr(pair_q)) == 3
    rows, n_keys, out = torch.randn(2, 8), torch.tensor([8, 9]), torch.full((2, 4), -5, dtype=torch.int64)
    work, tied = torch.empty(4 * 8), torch.empty(2, dtype=torch.uint8)
    assert lib.dsa_rows_topk(ptr(rows), 8, 2, ptr(n_keys), None, 0, 4, 16, 0, ptr(out), 4, ptr(work),
                             ptr(tied)) == KERNEL_BAD_ARGS  # 9 keys in a row of 8
    n_keys[1] = 8
    assert lib.dsa_rows_topk(ptr(rows), 8, 2, ptr(n_keys), None, 0, 5, 16, 0, ptr(out), 4, ptr(work),
                             ptr(tied)) == KERNEL_BAD_ARGS  # 5 slots into rows of 4
    assert torch.equal(out, torch.full((2, 4), -5))
    assert lib.dsa_rows_topk(ptr(rows), 8, 2, ptr(n_keys), None, 0, 4, 16, 0, ptr(out), 4, ptr(work), ptr(tied)) == 0
    assert torch.equal(out, rows.topk(4).indices.sort(-1).values)


ASAN_SCRIPT = """
import torch
from openglm.engine.quant import quantize_tensor
from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig, native
from openglm.model.glm5.sparse_dsa import dsa_attention
from openglm.model.quantized import QuantizedWeight, quantize_int4

assert native.decode_kernels() is not None and native.dsa_kernels() is not None, "kernels not built"
torch.manual_seed(0)
with torch.no_grad():
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 8, 20):
            x = torch.randn(rows, 48).to(dtype)
            w = torch.randn(40, 48).to(dtype)
            q = QuantizedWeight(*quantize_tensor(w, "int8"), dtype)
            ref = torch.nn.functional.linear(x.float(), w.float())
            assert (native.linear(x, w).float() - ref).abs().max() <= 0.1 * ref.abs().max()
            native.linear(x, q)
            for bad in (torch.randn(40, 32).to(dtype), torch.randn(40, 64).to(dtype)):  # narrower and wider
                try:
                    native.linear(x, bad)
                    raise SystemExit("a weight of another width was read")
                except ValueError:
                    pass
        xs = torch.randn(5, 32).to(dtype)
        gate_up, down = torch.randn(3, 32, 32).to(dtype), torch.randn(3, 32, 16).to(dtype)
        assert native.swiglu_ok(xs, gate_up, down)
        native.swiglu(xs, [2, 0, 3], gate_up, down)
        assert not native.swiglu_ok(xs, gate_up, torch.randn(3, 48, 16).to(dtype))
        assert native.heads_linear(torch.randn(3, 2, 32).to(dtype), torch.randn(2, 16, 32).to(dtype)) is not None
        native.rms_norm_bf16(torch.randn(3, 32).bfloat16(), torch.randn(32).bfloat16(), 1e-6)
        for group, width in ((32, 160), (128, 256)):  # int4: a last 32-code block; groups of 4 blocks
            w4 = QuantizedWeight(*quantize_int4(torch.randn(36, width), group), dtype)
            for rows in (1, 3, 8, 20):  # decode rows, and (bf16) the prefill kernel
                x = torch.randn(rows, width).to(dtype)
                ref = x.float() @ w4.dequantize().float().t()
                assert (native.linear(x, w4).float() - ref).abs().max() <= 0.05 * ref.abs().max()
        gu4, dn4 = (QuantizedWeight(*quantize_int4(torch.randn(*s), 32), dtype) for s in ((3, 64, 64), (3, 64, 32)))
        native.swiglu(torch.randn(5, 64).to(dtype), [2, 0, 3], gu4, dn4)
        torch.set_num_threads(2)  # weights past the kernels' split size: each thread's rows, its own buffer
        for w in (QuantizedWeight(*quantize_int4(torch.randn(1024, 256), 32), dtype), torch.randn(512, 256).to(dtype)):
            for rows in (1, 3, 20 if dtype == torch.bfloat16 else 8):
                x = torch.randn(rows, 256).to(dtype)
                ref = x.float() @ (w.dequantize() if isinstance(w, QuantizedWeight) else w).float().t()
                assert (native.linear(x, w).float() - ref).abs().max() <= 0.05 * ref.abs().max()
        torch.set_num_threads(1)
    q, k = torch.randn(1, 2, 40, 32), torch.randn(1, 1, 40, 32)
    dsa_attention(q, k, k[..., :16], torch.randn(1, 40, 2, 16), torch.randn(1, 40, 16), torch.rand(1, 40, 2), 8)
    for preset in ("tiny", "tiny-glm4-moe-lite"):
        cfg = ModelConfig.from_preset(preset, **({"index_topk": 4} if preset == "tiny" else {}))
        for dtype in (torch.float32, torch.bfloat16):
            m = GlmMoeDsaForCausalLM(cfg).eval().to(dtype)
            cache = DynamicCache()
            m(torch.randint(3, 200, (2, 12)), cache=cache)
            for _ in range(3):  # native decode steps, DSA selecting 4 of the keys
                m(torch.randint(3, 200, (2, 1)), cache=cache)
print("asan run ok")
"""


def _libasan() -> str | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    path = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.needs_native
@pytest.mark.skipif(_libasan() is None, reason="gcc's AddressSanitizer runtime (libasan) is not installed")
def test_kernels_run_clean_under_address_sanitizer(tmp_path, monkeypatch):
    """The kernels built with -fsanitize=address (in their own cache folder), run at tiny shapes: every native path
    the model takes (linear over fp32 / bf16 / int8 / int4 weights, split over two threads too, SwiGLU, per-head
    products, bf16 norms, the DSA kernels, whole decode steps) and the
    wrappers' refusals of mismatched shapes. A read or write past any buffer aborts the process with ASan's report."""
    # -O0: seconds to build (an optimised sanitized build took minutes), and no access optimised away
    monkeypatch.setenv("OPENGLM_CFLAGS", "-O0 -fsanitize=address -fno-omit-frame-pointer")
    monkeypatch.setenv("CC", "gcc")
    monkeypatch.setenv("OPENGLM_CACHE", str(tmp_path))
    built = [native.build("decode"), native.build("dsa")]  # here: the compiler must not run with the runtime preloaded
    env = {**os.environ, "LD_PRELOAD": _libasan(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "ASAN_OPTIONS": "detect_leaks=0"}  # the interpreter's own allocations are never freed: not leaks here
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(ASAN_SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "asan run ok" in run.stdout, run.stderr[-4000:]
    assert "AddressSanitizer" not in run.stderr
    assert sorted(tmp_path.glob("*.so")) == sorted(built)  # the sanitized libraries ran, nothing else was built
