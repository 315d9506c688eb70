"""Shared by the benchmark scripts: the CPU they ran on (figures compare only within one CPU), its ISA, the
same-run limits a figure is compared against (dense matmul peak, streaming memory bandwidth) and a median timer."""

import platform
import statistics
import time
from pathlib import Path

import torch

ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")  # /proc/cpuinfo names


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def isa() -> str:
    """The matmul-relevant ISA extensions this CPU reports, plus the kernels torch dispatches to."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        have = [f for f in ISA_FLAGS if f in flags.split()]
    except (OSError, StopIteration):
        have = []
    return (f"{' '.join(have) or 'no AVX2/AVX-512/AMX flags'}; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, "
            f"oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}")


def median_time(fn, repeats: int = 7, warmup: int = 1) -> float:
    """Median seconds of `repeats` calls after `warmup` untimed ones (the machines are shared and noisy)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one square n x n matmul in `dtype` on the current torch threads (the same-run peak)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats, warmup=2)


def memory_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum) of a buffer far larger than any L3, on the current torch threads:
    the bound a weight-streaming decode step is measured against."""
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return buf.numel() * 4 / median_time(lambda: buf.sum(), repeats, warmup=1)
