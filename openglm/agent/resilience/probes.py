"""Readers of the things the monitor watches: a process tree, a disk, the model endpoint, the GPU."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import psutil


@dataclass
class TreeSample:
    cpu_percent: float  # summed over the tree, 100 = one core busy
    rss_bytes: int
    open_files: int
    num_procs: int


class ProcessTree:
    """CPU, RSS and open files of some root processes and all their descendants.

    psutil's cpu_percent compares with the previous call on the *same* Process object, so the
    objects are kept between samples; processes that appear count from their second sample.
    """

    def __init__(self, roots):
        self._roots = roots if callable(roots) else (lambda: list(roots))
        self._procs: dict[int, psutil.Process] = {}
        self.roots: tuple[int, ...] = ()
        self.roots_changed = False  # the roots differ from the previous sample's (a new command)

    def members(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        roots = tuple(self._roots())
        self.roots_changed, self.roots = roots != self.roots, roots
        for pid in roots:
            try:
                root = self._procs.get(pid) or psutil.Process(pid)
                found[pid] = root
                for child in root.children(recursive=True):
                    found[child.pid] = self._procs.get(child.pid) or child
            except psutil.Error:
                continue
        self._procs = found
        return list(found.values())

    def sample(self) -> TreeSample:
        cpu, rss, files, n = 0.0, 0, 0, 0
        for proc in self.members():
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent(interval=None)
                    rss += proc.memory_info().rss
                    files += _open_files(proc)
                n += 1
            except psutil.Error:  # exited between listing and reading
                continue
        return TreeSample(cpu_percent=cpu, rss_bytes=rss, open_files=files, num_procs=n)


def _open_files(proc: psutil.Process) -> int:
    try:
        return proc.num_fds() if hasattr(proc, "num_fds") else len(proc.open_files())
    except psutil.Error:
        return 0


def disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


@dataclass
class EndpointSample:
    up: bool
    latency_s: float  # inf when unreachable
    status: int | None = None
    error: str | None = None


def probe_endpoint(url: str, timeout_s: float = 3.0) -> EndpointSample:
    """GET the endpoint; any HTTP answer under 500 means the server is reachable."""
    import httpx

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


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
