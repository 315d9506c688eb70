"""Things the monitor's actions do to the task's processes: throttle them, kill and restart them."""

from __future__ import annotations

import os
import subprocess
import threading

import psutil


class Parallelism:
    """The task's parallelism / model batch knob: halved on CPU overload, never below `minimum`."""

    def __init__(self, value: int, minimum: int = 1):
        self.initial = self.value = value
        self.minimum = minimum
        self._lock = threading.Lock()

    def reduce(self) -> int:
        with self._lock:
            self.value = max(self.minimum, self.value // 2)
            return self.value

    def restore(self) -> int:
        with self._lock:
            self.value = self.initial
            return self.value


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def renice_tree(pid: int, niceness: int = 10, include_root: bool = True) -> list[int]:
    """Lower the CPU priority of a process tree (raising niceness needs no privilege)."""
    changed = []
    for proc in tree(pid)[(0 if include_root else 1):]:
        try:
            if proc.nice() < niceness:
                proc.nice(niceness)
                changed.append(proc.pid)
        except psutil.Error:
            continue
    return changed


def kill_tree(pid: int, timeout_s: float = 3.0) -> list[int]:
    """SIGTERM a process tree, then SIGKILL what is left after `timeout_s`. Returns the pids."""
    procs = tree(pid)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    return [p.pid for p in procs]


class Supervised:
    """A child process tree that can be killed and started again (the sandboxed tool processes).

    `argv_fn()` returns the command to (re)start: after a restart it may resume from the last snapshot.
    """

    def __init__(self, argv_fn, cwd: str | None = None, env: dict | None = None):
        self.argv_fn = argv_fn if callable(argv_fn) else (lambda: list(argv_fn))
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._lock = threading.Lock()

    def start(self) -> int:
        with self._lock:
            self.proc = subprocess.Popen(self.argv_fn(), cwd=self.cwd, env=self.env, start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
                kill_tree(old.pid)
                old.wait()
        pid = self.start()
        self.restarts += 1  # counted once the new tree runs
        return f"restarted (pid {old.pid if old else None} -> {pid})"

    def stop(self):
        with self._lock:
            if self.proc is not None:
                kill_tree(self.proc.pid)
                self.proc.wait()
                self.proc = None

    def __del__(self):
        try:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
        except Exception:
            pass
