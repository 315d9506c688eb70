"""Resource limits for tool processes ("16CPU/64GB").

cgroup v2 where this process may create a child cgroup (cpu.max + memory.max cover the whole
process tree); otherwise CPU affinity + RLIMIT_AS on each command, plus a watchdog that kills the
command's process group when its total resident memory passes the limit.
"""

from __future__ import annotations

import os
import resource
import uuid
from pathlib import Path

import psutil

from openglm.agent.task import Resources


def _own_cgroup_v2() -> Path | None:
    root = Path("/sys/fs/cgroup")
    try:
        if not (root / "cgroup.controllers").exists():
            return None
        line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::"))
        path = root / line[3:].lstrip("/")
        return path if os.access(path, os.W_OK) else None
    except (OSError, StopIteration):
        return None


class ResourceLimiter:
    """Applies `resources` to each tool command; `mode` says how ("cgroup-v2", "rlimit", "none")."""

    def __init__(self, resources: Resources | None):
        self.resources = resources or Resources()
        self.cpus = self._pick_cpus(self.resources.cpus)
        self.cgroup: Path | None = None
        if self.resources.cpus is None and self.resources.memory_bytes is None:
            self.mode = "none"
        elif (parent := _own_cgroup_v2()) is not None and self._make_cgroup(parent):
            self.mode = "cgroup-v2"
        else:
            self.mode = "rlimit"

    @staticmethod
    def _pick_cpus(n: int | None) -> list[int] | None:
        if n is None:
            return None
        available = sorted(os.sched_getaffinity(0))
        return available[: max(1, min(n, len(available)))]  # asking for more than exists = all of them

    def _make_cgroup(self, parent: Path) -> bool:
        try:
            cg = parent / f"openglm-{uuid.uuid4().hex[:8]}"
            cg.mkdir()
            if self.resources.cpus:
                (cg / "cpu.max").write_text(f"{self.resources.cpus * 100000} 100000")
            if self.resources.memory_bytes:
                (cg / "memory.max").write_text(str(self.resources.memory_bytes))
            self.cgroup = cg
            return True
        except OSError:
            return False

    def describe(self) -> dict:
        return {"mode": self.mode, "cpus": self.cpus, "memory_bytes": self.resources.memory_bytes,
                "requested_cpus": self.resources.cpus}

    def preexec(self) -> None:
        """Runs in the child between fork and exec."""
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
            return
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if self.resources.memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (self.resources.memory_bytes, self.resources.memory_bytes))

    def over_memory(self, pgid: int) -> bool:
        """Watchdog check: total RSS of the process group above the limit?"""
        if not self.resources.memory_bytes or self.mode == "cgroup-v2":
            return False
        total = 0
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid:
                    total += p.memory_info().rss
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return total > self.resources.memory_bytes

    def close(self):
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError:
                pass
