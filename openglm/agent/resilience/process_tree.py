"""The task's process tree: what the resource monitor samples (CPU, RSS, open files of some root
processes and all their descendants), and what its actions do to it (lower its priority, narrow its
CPUs, restart a supervised child). Kills go through `openglm.util.proc`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import psutil

from openglm.util import proc


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
        for member in self.members():
            try:
                with member.oneshot():
                    cpu += member.cpu_percent(interval=None)
                    rss += member.memory_info().rss
                    files += _open_files(member)
                n += 1
            except psutil.Error:  # exited between listing and reading
                continue
        return TreeSample(cpu_percent=cpu, rss_bytes=rss, open_files=files, num_procs=n)


def _open_files(member: psutil.Process) -> int:
    try:
        return member.num_fds() if hasattr(member, "num_fds") else len(member.open_files())
    except psutil.Error:
        return 0


def renice_tree(pid: int, niceness: int = 10, include_root: bool = True) -> list[int]:
    """Lower the CPU priority of a process tree (raising niceness needs no privilege)."""
    changed = []
    for member in proc.tree(pid)[(0 if include_root else 1):]:
        try:
            if member.nice() < niceness:
                member.nice(niceness)
                changed.append(member.pid)
        except psutil.Error:
            continue
    return changed


def halve_affinity(pid: int) -> list[int]:
    """Give every process of the tree half of its CPUs (at least one). Returns the pids narrowed."""
    out = []
    for member in proc.tree(pid):
        try:
            cpus = member.cpu_affinity()
            if len(cpus) > 1:
                member.cpu_affinity(cpus[: len(cpus) // 2])
                out.append(member.pid)
        except (psutil.Error, AttributeError):
            continue
    return out


class Supervised:
    """A child process tree that can be killed and started again (the sandboxed tool processes).

    `argv_fn()` returns the command to (re)start: after a restart it may resume from the last snapshot.
    """

    def __init__(self, argv_fn, cwd: str | None = None, env: dict | None = None):
        self.argv_fn = argv_fn if callable(argv_fn) else (lambda: list(argv_fn))
        self.cwd, self.env = cwd, env
        self.proc = None
        self.restarts = 0
        self._lock = threading.Lock()

    def start(self) -> int:
        with self._lock:
            self.proc = proc.spawn(self.argv_fn(), cwd=self.cwd, env=self.env, stdout=proc.DEVNULL,
                                   stderr=proc.DEVNULL)
            return self.proc.pid

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []

    def restart(self, *_):
        with self._lock:
            old = self.proc
            if old is not None:
                proc.kill_tree(old.pid)
                old.wait()
        pid = self.start()
        self.restarts += 1  # counted once the new tree runs
        return f"restarted (pid {old.pid if old else None} -> {pid})"

    def stop(self):
        with self._lock:
            if self.proc is not None:
                proc.kill_tree(self.proc.pid)
                self.proc.wait()
                self.proc = None

    def __del__(self):
        try:
            if self.proc is not None and self.proc.poll() is None:
                proc.kill_group(self.proc.pid)
        except Exception:
            pass
