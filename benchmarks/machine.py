"""Shared by the benchmark scripts: the CPU they ran on (figures compare only within one CPU) and a median timer."""

import platform
import statistics
import time
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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
