"""What the Triton launchers share: where a kernel may run, the dot product's operand handling, and the block
table through which the kernels address cache rows."""

from __future__ import annotations

import os

import torch
import triton

# Triton decides at decoration time (when a kernel module is imported) whether @triton.jit builds a compiled
# kernel or an interpreted one; this reads the same switch at the same moment.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor | None) -> torch.device:
    """The one device of `tensors` (None entries are ignored); a clear error for CPU tensors outside the
    interpreter (a compiled kernel reads device memory) or for tensors on several devices."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"the kernel's tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"Triton kernels run on CUDA tensors (got {device.type}); CPU tensors run in Triton's "
                         "interpreter only, with TRITON_INTERPRET=1 set before openglm.kernels is imported")
    return device


def next_pow2(n: int, least: int = 16) -> int:
    """Block width for n channels: a power of two (tl.arange needs one), at least 16 (tensor-core dot tiles)."""
    return max(least, triton.next_power_of_2(max(1, n)))


def dot_options(dtype: torch.dtype, fp32: str = "ieee") -> tuple[bool, str]:
    """(upcast, input_precision) for a dot over operands of `dtype`.

    upcast: the interpreter stores bf16 as its bit pattern and its tl.dot would multiply those (Triton's
    documented limit: bf16 arithmetic needs a cast to fp32 there), so under the interpreter the kernels widen
    dot operands to fp32 first. On a GPU a bf16 x bf16 product is exact in fp32 and accumulates in fp32, so the
    widened interpreter dot computes the same sums up to their order.
    input_precision: fp32 operands use `fp32`: "ieee" (exact fp32 products, as the PyTorch reference computes
    them) or "tf32x3" (fp32-level accuracy from three TF32 tensor-core products), never Triton's default TF32,
    which keeps only 10 mantissa bits of each operand. The interpreter computes exact fp32 products either way."""
    return INTERPRET, fp32 if dtype == torch.float32 else "tf32"


def contiguous_table(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A [B, N, W] (or [B, N, 1, W]) tensor of cache rows as the kernels address the engine's paged pool:
    (rows: `t` itself, the pointer of row 0, int32 block table [B, 1], page size). Position j of sequence b is
    then row table[b, j // page] * page + j % page = b * page + j of the storage, rows `page` apart per sequence.
    Views of a preallocated cache (rows a whole capacity apart) need no copy; other layouts are copied."""
    b, n = t.shape[:2]
    w = t.shape[-1]
    row = t.stride(1)
    if t.stride(-1) != 1 or (t.dim() == 4 and t.shape[2] != 1) or row < w or (b > 1 and t.stride(0) % row):
        t = t.reshape(b, n, w).contiguous()
        row = w
    page = t.stride(0) // row if b > 1 else max(n, 1)
    table = torch.arange(b, dtype=torch.int32, device=t.device)[:, None]
    return t, table, page
