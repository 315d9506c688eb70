"""How many CPU threads torch (and the native kernels, which follow it) should use now, on a machine others share.

An OpenMP team waits at the end of every parallel region for its slowest thread. When another process takes one of
the cores the team runs on, the thread there gets that core only part of the time and every region waits for it; a
decode step runs hundreds of regions, so a 2-thread step on 2 cores with one busy competitor ran at ~0.05x of its
quiet rate, and a training step 7.8x slower (docs/model.md, "A busy machine"). `ThreadGovernor` samples the
machine's busy time (/proc/stat) against this process's own CPU time every `interval` seconds (what our threads
burn, spinning included, is ours) and gives the work only the cores others leave free (`choose`). The engine polls
it before each step and the trainer before each optimizer step; OPENGLM_ADAPTIVE_THREADS=0 turns it off.

`quiet_wait_policy` sets libgomp's wait policy before torch starts its thread pool: threads that finish a region
spin for a short while (GOMP_SPINCOUNT) and then sleep, so a team that no longer has all its cores does not keep
burning the one it shares with the competitor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SPINCOUNT = "10000"  # libgomp spins this many times (~10 us) before sleeping; its default is 300000 (~0.3 ms)
RAISE_MARGIN = 0.25  # a core others use must be this far below half-busy before a thread goes back on it


def quiet_wait_policy() -> None:
    """Set libgomp's spin count before torch loads it (a no-op once it is loaded, or when the user set one)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)


def usable_cores() -> int:
    """The cores this process may run on (affinity, e.g. a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def choose(limit: int, cores: int, others: float, current: int) -> int:
    """Threads to run with: at most `limit`, one per core that others (using `others` cores' worth of CPU) leave
    free, at least one. A core counts as taken when others use half of it or more; a thread goes back on a freed core
    only once others are RAISE_MARGIN below that, so a competitor near the threshold does not make it flap."""
    taken = min(cores, math.floor(max(others, 0.0) + 0.5))
    target = max(1, min(limit, cores - taken))
    if target > current:
        taken_strict = min(cores, math.floor(max(others, 0.0) + 0.5 + RAISE_MARGIN))
        target = max(current, min(target, cores - taken_strict))
    return target


def read_proc_stat(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy seconds, total seconds) summed over all CPUs since boot, or None where there is no /proc/stat."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest is inside user)
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


@dataclass
class ThreadGovernor:
    """Polled before each step: `poll()` re-samples at most every `interval` seconds and, when the free cores changed,
    calls `apply(threads)` (default: torch.set_num_threads) and returns the new count, else None."""
    limit: int
    interval: float = 1.0
    cores: int = field(default_factory=usable_cores)
    apply: Callable[[int], None] | None = None
    clock: Callable[[], float] = time.monotonic
    own_cpu: Callable[[], float] = time.process_time  # CPU seconds of all this process's threads
    machine: Callable[[], tuple[float, float] | None] = read_proc_stat
    current: int = 0
    others: float = 0.0  # cores' worth of CPU others used over the last interval
    _last: tuple[float, float, float] | None = None

    def __post_init__(self):
        self.limit = max(1, min(self.limit, self.cores))
        self.current = self.current or self.limit

    @classmethod
    def for_torch(cls, interval: float = 1.0) -> "ThreadGovernor | None":
        """A governor over torch's current thread count (the user's --threads or all cores), or None: disabled
        (OPENGLM_ADAPTIVE_THREADS=0), one thread already, or no /proc/stat."""
        import torch  # the caller runs torch work; torch is loaded already

        if os.environ.get("OPENGLM_ADAPTIVE_THREADS", "1") == "0" or read_proc_stat() is None:
            return None
        limit = torch.get_num_threads()
        return None if limit < 2 else cls(limit, interval, apply=torch.set_num_threads)

    def poll(self) -> int | None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return None
        sample = self.machine()
        if sample is None:
            return None
        mine = self.own_cpu()
        last, self._last = self._last, (now, sample[0], mine)
        if last is None or now <= last[0]:
            return None
        self.others = max(0.0, ((sample[0] - last[1]) - (mine - last[2])) / (now - last[0]))
        threads = choose(self.limit, self.cores, self.others, self.current)
        if threads == self.current:
            return None
        self.current = threads
        if self.apply is not None:
            self.apply(threads)
        return threads
