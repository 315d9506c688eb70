"""Native CPU kernels, compiled on first use and loaded with ctypes.

- `dsa_kernels()` (`dsa_kernels.c`): two steps of gather-based DSA that have no efficient form as torch ops on
  the CPU: the lightning indexer's per-row top-k (as torch ops, 6-8 passes over each score row: relu, head
  sum, mask, sample top-k, compare, nonzero, gathers) and the scores / weighted sums of the selected (query,
  key) pairs (`sampled_addmm` runs at ~5 GFLOP/s, `embedding_bag` reads each query's rows at random). The C
  does each in one or two passes over cache-resident data.
- `decode_kernels()` (`decode_kernels.c`): a decode step's few-row products (routed experts, projections,
  MLA's per-head absorption), whose weights small-row BLAS calls read at ~5 GB/s; the C streams each fp32,
  bf16, int8 or int4 weight row once (int8 and int4 in place, with their scales), ~2x faster cold; and the int4
  products of any row count (`int4_kernels.h`: a prefill's, which no ATen kernel reads in this layout).
  Products of large weights are split over torch's thread count with OpenMP (`-fopenmp`: the libgomp torch
  loaded, so one thread pool and one wait policy for both; `set_kernel_threads` follows torch.set_num_threads).

Both include `kernels.h` (the SIMD helpers, the top-k selection and the error codes they share). Each is compiled
once (~0.3 s) with the system C compiler (`cc`, or $CC; extra flags from $OPENGLM_CFLAGS, e.g. a sanitizer) into
~/.cache/openglm (or $OPENGLM_CACHE), keyed by the sources, flags and CPU (`-march=native`). Without a compiler, or
with OPENGLM_NATIVE=0 (all) / OPENGLM_DSA_NATIVE=0 / OPENGLM_DECODE_NATIVE=0, a loader returns None and the caller
runs its torch-op path; a compiler whose build fails gives a warning with its error, then the same fallback.

Every exported function checks its own size and limit arguments: it returns KERNEL_BAD_ARGS (writing nothing) for
one outside what it takes and KERNEL_NO_MEMORY when a buffer cannot be allocated; `check` turns both into
exceptions at every call site, so a refused call never leaves garbage in an output.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from openglm.model.quantized import QuantizedWeight

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fopenmp"]
HEADERS = ("kernels.h", "int4_kernels.h")
KERNEL_BAD_ARGS, KERNEL_NO_MEMORY = -1, -2  # the error codes of kernels.h
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
DSA_SIGNATURES = {  # argument and result types of each exported function (see dsa_kernels.c)
    "dsa_pairs_by_key": ([_P, _I, _I, _I, _P, _P], _I),
    "dsa_pair_scores": ([_P, _I, _P, _I, _I, _I, _F, _P, _P, _P, _P, _I], _I),
    "dsa_pair_values": ([_P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I], _I),
    "dsa_pair_exp": ([_P, _P, _P, _I], _I),
    "dsa_head_sum": ([_P, _C, _I, _I, _I, _P, _P, _I, _P, _I], _I),
    "dsa_rows_topk": ([_P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P, _P], _I),
}
DECODE_SIGNATURES = {"experts_swiglu": ([_P, _P, _I, _P, _P, _P, _P, _C, _I, _I, _I, _P, _P], _C),
                     "rows_linear": ([_P, _I, _P, _P, _C, _I, _C, _I, _I, _P], _C),
                     "heads_linear": ([_P, _I, _I, _P, _P, _C, _I, _I, _I, _I, _I, _P], _C),
                     "i4_matmul": ([_P, _I, _I, _P, _P, _I, _I, _I, _P, _C, _I], _C),
                     "set_kernel_threads": ([_I], _I),
                     "rms_norm_bf16": ([_P, _I, _I, _P, _F, _P], _C),
                     "mla_decode_select": ([_P, _P, _I, _P, _P, _P, _P, _P, _I, _P], _I),
                     "mla_decode_attend": ([_P, _P, _I, _P, _P, _P, _I, _P], _C),
                     "ffn_decode": ([_P, _I, _P, _P], _C),
                     "decode_limits": ([_P], _I),
                     "decode_features": ([], _C),
                     "path_selections": ([_I], _I)}


class KernelError(ValueError):
    """A native kernel refused its arguments (a size or limit outside what it takes): a caller's bug, never input."""


def check(rc: int, kernel: str) -> int:
    """A kernel's result, or the exception its error code means (MemoryError: a working buffer could not be
    allocated; KernelError: it refused its size or limit arguments). Every call site passes its result through."""
    if rc == KERNEL_NO_MEMORY:
        raise MemoryError(f"native kernel {kernel}: out of memory for its working buffers")
    if rc < 0:
        raise KernelError(f"native kernel {kernel} refused its arguments (error {rc}): a size or limit outside what "
                          "it takes")
    return rc


def _cpu_id() -> str:
    """What -march=native compiles for: a library built on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


@dataclass(frozen=True)
class DecodeLimits:
    """What decode_kernels.c takes (its MAX_ROWS, HEADS_MAX_WIDTH, STEP_MAX_WIDTH, read from the library): rows per
    weight, heads_linear's per-head widths, the widths of a decode step's layer (hidden, kv rank, experts, indexer
    heads x width). All 0 without the library: no native path applies."""
    max_rows: int = 0
    heads_max_width: int = 0
    step_max_width: int = 0


@functools.lru_cache(maxsize=1)
def dsa_kernels():
    """The DSA kernels (a ctypes library), or None: disabled, no compiler, or the build failed."""
    return _load("dsa", DSA_SIGNATURES, "OPENGLM_DSA_NATIVE")


@functools.lru_cache(maxsize=1)
def decode_kernels():
    """The decode-step expert kernels (a ctypes library), or None, as `dsa_kernels`."""
    return _load("decode", DECODE_SIGNATURES, "OPENGLM_DECODE_NATIVE")


@functools.lru_cache(maxsize=1)
def decode_limits() -> DecodeLimits:
    """The decode kernels' limits, as the C defines them (zeros without the library)."""
    lib = decode_kernels()
    if lib is None:
        return DecodeLimits()
    out = (ctypes.c_int64 * 3)()
    check(lib.decode_limits(out), "decode_limits")
    return DecodeLimits(*out)


def max_rows() -> int:
    """The most rows a decode kernel takes per weight (0: no decode kernels)."""
    return decode_limits().max_rows


def decode_paths() -> str:
    """Which weight paths the decode kernels were built with (for benchmark tables)."""
    lib = decode_kernels()
    if lib is None:
        return "off (torch ops)"
    f = lib.decode_features()
    return ", ".join([("bf16 vdpbf16ps" if f & 1 else "bf16 widened to fp32"),
                      ("int8 vpdpwssd" if f & 2 else "int8 widened to fp32"),
                      ("int4 vpermw + vdpbf16ps" if f & 4 else "int4 widened to fp32"), "fp32 FMA",
                      ("DSA scan of the int8 key shadow (vpdpbusd)" if f & 2 else "DSA scan of the keys")])


def _load(name: str, signatures: dict, switch: str):
    if "0" in (os.environ.get("OPENGLM_NATIVE", "1"), os.environ.get(switch, "1")):
        return None
    try:
        path = build(name)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-300:]
        warnings.warn(f"openglm: {name} native kernels unavailable ({e} {detail}); using the torch-op path")
        return None
    for fn_name, (args, res) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = args, res
    return lib


def build(name: str) -> Path | None:
    """The compiled library `{name}_kernels.c` ("decode" or "dsa"), built into the cache if it is not there yet
    (with $CC and $OPENGLM_CFLAGS as `_load` uses them); None without a compiler. Raises what the compiler raised."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    source = Path(__file__).with_name(f"{name}_kernels.c")
    headers = [Path(__file__).with_name(h).read_text() for h in HEADERS]
    flags = FLAGS + shlex.split(os.environ.get("OPENGLM_CFLAGS", ""))
    key = hashlib.sha256("\n".join([source.read_text(), *headers, cc, *flags, platform.machine(),
                                    _cpu_id()]).encode())
    cache = Path(os.environ.get("OPENGLM_CACHE") or Path.home() / ".cache" / "openglm")
    path = cache / f"{name}_{key.hexdigest()[:16]}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: atomic for others
            lib = Path(tmp) / f"{name}.so"
            subprocess.run([cc, *flags, str(source), "-o", str(lib), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(lib, path)
    return path


def ptr(t: torch.Tensor) -> int:
    """A tensor's data address for a kernel argument (callers pass contiguous tensors of the right dtype)."""
    return t.data_ptr()


W_F32, W_BF16, W_I8, W_I4 = 0, 1, 2, 3  # the weight element types of decode_kernels.c


@dataclass(frozen=True)
class KernelWeight:
    """A weight as `decode_kernels.c` reads it: its values (fp32 / bf16 in place; an int8 `QuantizedWeight`'s int8
    values, an int4 one's packed codes), their scales (int8: fp32 per row; int4: bf16 per group of `group` columns;
    else None) and the weight type."""
    values: torch.Tensor
    scale: torch.Tensor | None
    wtype: int
    group: int = 0

    def __iter__(self):  # (values, scale, wtype), as callers unpack it
        return iter((self.values, self.scale, self.wtype))

    def __getitem__(self, i):
        return (self.values, self.scale, self.wtype)[i]

    def contiguous(self) -> bool:
        return self.values.is_contiguous() and (self.scale is None or self.scale.is_contiguous())


def kernel_weight(w: torch.Tensor) -> KernelWeight | None:
    """`w` as `decode_kernels.c` reads it, in place (no dequantised copy), or None for other weights (fp8, fp16).
    Callers check the values' strides."""
    if isinstance(w, QuantizedWeight):
        if w.is_int4:
            return KernelWeight(w.qdata, w.scale, W_I4, w.group)
        return KernelWeight(w.qdata, w.scale, W_I8) if w.qdata.dtype == torch.int8 else None
    if w.dtype in (torch.float32, torch.bfloat16):
        return KernelWeight(w, None, W_BF16 if w.dtype == torch.bfloat16 else W_F32)
    return None


def sync_threads(lib) -> None:
    """The kernels' thread count follows torch's (set_num_threads, or the engine's thread governor)."""
    threads = torch.get_num_threads()
    if threads != _threads[0]:
        check(lib.set_kernel_threads(threads), "set_kernel_threads")
        _threads[0] = threads


_threads = [0]


def scale_ptr(scale: torch.Tensor | None) -> int | None:
    return None if scale is None else scale.data_ptr()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias) for the inference paths (`fast.Inference`: no autograd, so no graph is recorded);
    a decode step's few rows through `decode_kernels.c`, which streams each weight row once (small-row BLAS reads
    cold weights at ~5 GB/s; fp32 accumulation).
    fp32 or bf16 x with a weight of its dtype or an int8 / int4 `QuantizedWeight`; more rows of bf16 x over an
    int8 weight take ATen's weight-only int8 matmul, over an int4 one `int4_matmul`, both reading the quantised
    values in place. A weight whose inner width is not x's raises, as F.linear does."""
    if w.dim() != 2 or w.shape[-1] != x.shape[-1]:
        raise ValueError(f"linear: weight {tuple(w.shape)} does not take input {tuple(x.shape)} (its inner width "
                         f"must be the input's last, {x.shape[-1]})")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    kw = kernel_weight(w) if (x.device.type == "cpu" and x.dtype == w.dtype
                              and x.dtype in (torch.float32, torch.bfloat16)) else None
    if kw is None or not kw.contiguous():
        return torch.nn.functional.linear(x, w)
    values, scale, wtype = kw
    m, k = w.shape
    if 0 < rows <= max_rows() and k % 16 == 0:
        xr = x.reshape(rows, k).contiguous()
        out = xr.new_empty(rows, m)
        lib = decode_kernels()
        sync_threads(lib)
        check(lib.rows_linear(ptr(xr), rows, ptr(values), scale_ptr(scale), wtype, kw.group,
                              int(x.dtype == torch.bfloat16), m, k, ptr(out)), "rows_linear")
        return out.view(*x.shape[:-1], m)
    if wtype == W_I4 and x.dtype == torch.bfloat16 and rows:
        return int4_matmul(x.reshape(rows, k), kw, m).view(*x.shape[:-1], m)
    if wtype == W_I8 and x.dtype == torch.bfloat16:
        xr = x.reshape(-1, k).contiguous()
        return torch._weight_int8pack_mm(xr, values, scale.view(-1).to(x.dtype)).view(*x.shape[:-1], m)
    return torch.nn.functional.linear(x, w)


def heads_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [rows, H, k] times w [H, m, k] transposed per head -> [rows, H, m] in x's dtype through
    `decode_kernels.c` (a decode step's MLA absorption: small bmms cost more in set-up than in reading w),
    or None when the kernel does not apply (the caller runs its bmm). w: fp32, bf16 or int8 `QuantizedWeight`.
    For the inference paths (no autograd)."""
    rows, heads, k = x.shape
    if w.dim() != 3 or w.shape[0] != heads or w.shape[-1] != k:
        raise ValueError(f"heads_linear: weight {tuple(w.shape)} does not take input {tuple(x.shape)} (expected "
                         f"[{heads}, m, {k}])")
    m, limits = w.shape[1], decode_limits()
    kw = kernel_weight(w)
    if not (kw is not None and 0 < rows <= limits.max_rows and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and kw[0].stride(-1) == 1 and kw[0].stride(-2) == kw[0].shape[-1] and k % 16 == 0
            and max(k, m) <= limits.heads_max_width):
        return None
    values, scale, wtype = kw
    if scale is not None and (scale.stride(-1) != 1 or scale.stride(-2) != scale.shape[-1]):
        return None
    xf = x.float().contiguous()
    out = xf.new_empty(rows, heads, m)
    lib = decode_kernels()
    sync_threads(lib)
    head = values.stride(0) * (2 if wtype == W_I4 else 1)  # in weights: int4 codes are two a byte
    check(lib.heads_linear(ptr(xf), rows, heads, ptr(values), scale_ptr(scale), wtype, kw.group, head,
                           0 if scale is None else scale.stride(0), m, k, ptr(out)), "heads_linear")
    return out.to(x.dtype)


def rms_norm_bf16(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of bf16 x with a bf16 weight as `norm.RMSNorm` computes it (fp32 statistics, the reference's two
    bf16 roundings) in one C call for the inference paths (no autograd), or None where the kernel does not apply
    (the caller runs the torch ops): on the CPU, a width that is a multiple of 16."""
    dim = x.shape[-1]
    if not (x.device.type == "cpu" and x.dtype == w.dtype == torch.bfloat16
            and w.is_contiguous() and 0 < dim and dim % 16 == 0 and w.numel() == dim
            and decode_kernels() is not None):
        return None
    x = x.contiguous()  # a slice of a fused projection's output: one copy, still far fewer ops than the torch path
    out = torch.empty_like(x)
    check(decode_kernels().rms_norm_bf16(ptr(x), x.numel() // dim, dim, ptr(w), eps, ptr(out)), "rms_norm_bf16")
    return out


def swiglu_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `swiglu` runs a SwiGLU with these weights: gate_up [..., 2I, H] and down [..., H, I] of one shape
    apart from those (E weight sets, or one), x [..., H]; fp32 or bf16 x with weights of its dtype (or int8
    `QuantizedWeight`s of one), contiguous CPU tensors, H and I multiples of 16, and the decode kernels."""
    H, inter = down.shape[-2:]
    if not (gate_up.dim() == down.dim() and gate_up.shape[:-2] == down.shape[:-2]
            and tuple(gate_up.shape[-2:]) == (2 * inter, H) and x.shape[-1] == H):
        return False
    if not (x.device.type == "cpu" and H % 16 == 0 and inter % 16 == 0
            and x.dtype == gate_up.dtype == down.dtype and x.dtype in (torch.float32, torch.bfloat16)
            and decode_kernels() is not None):
        return False
    a, b = kernel_weight(gate_up), kernel_weight(down)
    return (a is not None and b is not None and a.wtype == b.wtype and a.group == b.group
            and a.contiguous() and b.contiguous())


def swiglu(xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of each of E weight sets (gate_up [E, 2I, H] or [2I, H], down [E, H, I] or [H, I]) over its
    consecutive rows of xs [sum(counts), H] (at most `max_rows()` each), in one C call that streams every weight
    row once: small-row BLAS calls read cold weights at ~5 GB/s, this ~2x faster. fp32 accumulation. The caller
    checks `swiglu_ok`; counts that do not fit the weights or the rows raise."""
    H, inter = down.shape[-2:]
    sets = gate_up.shape[0] if gate_up.dim() == 3 else 1
    if len(counts) != sets or sum(counts) != xs.shape[0] or xs.shape[-1] != H:
        raise ValueError(f"swiglu: row counts {counts} over input {tuple(xs.shape)} do not fit {sets} weight set(s) "
                         f"of width {H}")
    a, b = kernel_weight(gate_up), kernel_weight(down)
    x = xs.float().contiguous()
    out, work = torch.empty_like(x), x.new_empty(max_rows() * 3 * inter)
    rows = torch.tensor(counts, dtype=torch.int64)  # held here: the kernel reads it through a raw pointer
    lib = decode_kernels()
    sync_threads(lib)
    check(lib.experts_swiglu(ptr(x), ptr(rows), len(counts), ptr(a.values), ptr(b.values), scale_ptr(a.scale),
                             scale_ptr(b.scale), a.wtype, a.group, H, inter, ptr(out), ptr(work)), "experts_swiglu")
    return out.to(xs.dtype)


def int4_matmul(x: torch.Tensor, kw: KernelWeight, m: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] bf16 times an int4 weight [m, k] (`kernel_weight` of it) transposed -> bf16 [rows, m] (or into
    `out`, a bf16 [rows, m] view with unit column stride), through `int4_kernels.h`: each block of four weight
    rows dequantised once to bf16 (the torch path's values) and multiplied into every row, for any row count."""
    rows, k = x.shape
    if kw.wtype != W_I4 or x.dtype != torch.bfloat16 or kw.values.shape[-1] * 2 != k:
        raise ValueError(f"int4_matmul: input {tuple(x.shape)} {x.dtype} does not fit the int4 weight")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = x.new_empty(rows, m)
    lib = decode_kernels()
    sync_threads(lib)
    check(lib.i4_matmul(ptr(x), rows, x.stride(0), ptr(kw.values), ptr(kw.scale), kw.group, m, k, ptr(out), 1,
                        out.stride(0)), "i4_matmul")
    return out
