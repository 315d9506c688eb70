"""Probes: the readings the resource monitor takes besides the task's process tree (disk, the model
endpoint, the GPU, the machine's CPU count)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass


def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class EndpointSample:
    up: bool
    latency_s: float  # inf when unreachable
    status: int | None = None
    error: str | None = None


def probe_endpoint(url: str, timeout_s: float = 3.0) -> EndpointSample:
    """GET the endpoint; any HTTP answer under 500 means the server is reachable."""
    import httpx  # loaded with the first probe (the monitor is optional)

    start = time.perf_counter()
    try:
        resp = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return EndpointSample(up=False, latency_s=float("inf"), error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    return EndpointSample(up=resp.status_code < 500, latency_s=latency, status=resp.status_code)


class Gpu:
    """NVML readings when pynvml and a GPU are present; `available` is False otherwise."""

    def __init__(self):
        self.available = False
        self.reason = "pynvml not installed"
        try:
            import pynvml  # optional dependency
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no driver / no device: NVMLError has many subclasses
            self.reason = f"NVML unavailable: {exc}"
            return
        if not self._handles:
            self.reason = "no GPU"
            return
        self._nvml = pynvml
        self.available, self.reason = True, ""

    def sample(self) -> dict | None:
        if not self.available:
            return None
        nv, ecc, used, total = self._nvml, 0, 0, 0
        for h in self._handles:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            used, total = used + mem.used, total + mem.total
            try:
                ecc += nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            except nv.NVMLError:  # ECC not supported on this board
                pass
        return {"ecc_errors": ecc, "memory_used_bytes": used, "memory_total_bytes": total, "count": len(self._handles)}
