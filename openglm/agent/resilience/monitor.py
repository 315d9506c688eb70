"""The resource monitor: samples a task's process tree and the machine, acts on thresholds.

Each sample is a flat dict of readings (shown in the task status and exported to Prometheus).
A reading that crosses its threshold for `sustain` samples in a row fires the threshold's action
(at most once per `cooldown_s`); crossings, clearings and actions are reported as events.

Also in this module:

- Readers of the things the monitor watches: a process tree, a disk, the model endpoint, the GPU.

- Memory-leak detection from RSS samples: a robust slope, so one spike is not a leak.

  The slope is Theil-Sen (the median of all pairwise slopes): a single 100 MB spike moves a
  least-squares fit a lot but leaves the median untouched. A leak must also be a *trend*: the
  Kendall tau of the samples (share of concordant minus discordant pairs) must be high, which
  rejects noisy processes whose median slope happens to be positive.

- Things the monitor's actions do to the task's processes: throttle them, kill and restart them.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import psutil

from .config import Action, FLOOR_METRICS, MonitorConfig


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


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def theil_sen(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Return (slope, kendall_tau) of y over t. Needs at least 3 points with distinct t."""
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    dy = y[j] - y[i]
    ok = dt > 0
    if ok.sum() < 3:
        return 0.0, 0.0
    slope = float(np.median(dy[ok] / dt[ok]))
    tau = float(np.sign(dy[ok]).sum() / ok.sum())
    return slope, tau


@dataclass
class GrowthEstimate:
    rate: float  # bytes per second (Theil-Sen)
    tau: float  # Kendall tau in [-1, 1]
    span_s: float  # time covered by the samples used
    n: int


class Window:
    """Samples of the last `span_s` seconds, thinned to at most `max_samples` (every other one dropped)."""

    def __init__(self, span_s: float, max_samples: int = 240):
        self.span_s = span_s
        self.max_samples = max_samples
        self.samples: deque[tuple[float, float]] = deque()
        self._min_gap = span_s / max_samples  # samples closer than this are merged into the newest

    def add(self, t: float, value: float):
        # Bounded resolution: while the newest sample is younger than the gap, it is replaced
        # (it always holds the latest reading); otherwise a new one is appended.
        if len(self.samples) > 1 and t - self.samples[-2][0] < self._min_gap:
            self.samples[-1] = (t, value)
        else:
            self.samples.append((t, value))
        self._trim(t)

    def _trim(self, now: float):
        while self.samples and now - self.samples[0][0] > self.span_s:
            self.samples.popleft()

    def clear(self):
        self.samples.clear()

    def estimate(self) -> GrowthEstimate | None:
        if len(self.samples) < 3:
            return None
        arr = np.asarray(self.samples, dtype=np.float64)
        t, y = arr[:, 0] - arr[0, 0], arr[:, 1]
        rate, tau = theil_sen(t, y)
        return GrowthEstimate(rate=rate, tau=tau, span_s=float(t[-1]), n=len(t))


@dataclass
class LeakVerdict:
    rule: str  # "rss_growth_short" or "rss_growth_long"
    rate: float  # bytes/s
    limit: float
    tau: float
    span_s: float


class LeakDetector:
    """Two windows (short: the MB/min rule, long: the MB/h rule) over the RSS of one process tree."""

    def __init__(self, short_window_s: float, long_window_s: float, short_limit: float, long_limit: float,
                 min_window_fraction: float = 0.5, trend_min: float = 0.6, max_samples: int = 240):
        self.rules = {
            "rss_growth_short": (Window(short_window_s, max_samples), short_limit),
            "rss_growth_long": (Window(long_window_s, max_samples), long_limit),
        }
        self.min_window_fraction = min_window_fraction
        self.trend_min = trend_min

    def add(self, t: float, rss: float):
        for window, _ in self.rules.values():
            window.add(t, rss)

    def reset(self):
        """After a restart the old samples say nothing about the new process."""
        for window, _ in self.rules.values():
            window.clear()

    def rates(self) -> dict[str, GrowthEstimate | None]:
        return {name: window.estimate() for name, (window, _) in self.rules.items()}

    def check(self) -> LeakVerdict | None:
        for name, (window, limit) in self.rules.items():
            est = window.estimate()
            if est is None or est.span_s < self.min_window_fraction * window.span_s:
                continue
            if est.rate > limit and est.tau >= self.trend_min:
                return LeakVerdict(rule=name, rate=est.rate, limit=limit, tau=est.tau, span_s=est.span_s)
        return None


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


@dataclass
class Alert:
    metric: str
    value: float
    limit: float
    action: Action
    detail: dict

    def to_dict(self) -> dict:
        return {"metric": self.metric, "value": _finite(self.value), "limit": self.limit,
                "action": self.action.value, **self.detail}


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


class ResourceMonitor:
    """Watch a task. `roots` are pids (or a callable returning them) whose trees are the task's processes.

    on_event(kind, data) receives "threshold_crossed", "threshold_cleared" and "monitor_action";
    handlers[action](alert) perform the actions (the runtime supplies them).
    """

    def __init__(self, config: MonitorConfig, roots, workspace: str = ".",
                 on_event: Callable[[str, dict], None] | None = None,
                 handlers: dict[Action, Callable[[Alert], None]] | None = None,
                 metrics=None, task_id: str = "task", clock: Callable[[], float] = time.monotonic,
                 on_sample: Callable[[dict], None] | None = None):
        self.config = config
        self.tree = ProcessTree(roots)
        self.workspace = workspace
        self.on_event = on_event or (lambda kind, data: None)
        self.handlers = dict(handlers or {})
        self.metrics, self.task_id, self.clock, self.on_sample = metrics, task_id, clock, on_sample
        self.leaks = LeakDetector(config.short_window_s, config.long_window_s,
                                  config.limit("rss_growth_short"), config.limit("rss_growth_long"),
                                  config.min_window_fraction, config.trend_min, config.max_samples)
        self.gpu = Gpu()
        self.allotment = config.cpu_allotment or cpu_count()
        self.latest: dict = {}
        self.alerts: list[Alert] = []
        self._streak: dict[str, int] = {}
        self._last_action: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        psutil.cpu_percent(interval=None)  # prime the machine-wide counter

    # -- sampling -------------------------------------------------------------------------------
    def read(self) -> dict:
        now = self.clock()
        tree = self.tree.sample()
        if self.tree.roots_changed:  # another command (or a restarted tree): its history starts now
            self.leaks.reset()
        self.leaks.add(now, tree.rss_bytes)
        rates = self.leaks.rates()
        reading = {
            "t": now,
            "cpu_percent": tree.cpu_percent / self.allotment,
            "tree_cpu_percent": tree.cpu_percent,
            "machine_cpu_percent": psutil.cpu_percent(interval=None),
            "rss_bytes": tree.rss_bytes,
            "rss_growth_short": rates["rss_growth_short"].rate if rates["rss_growth_short"] else 0.0,
            "rss_growth_long": rates["rss_growth_long"].rate if rates["rss_growth_long"] else 0.0,
            "open_files": tree.open_files,
            "num_procs": tree.num_procs,
            "disk_free_bytes": disk_free(self.workspace),
            "gpu": self.gpu.sample() if self.gpu.available else None,
            "gpu_status": "present" if self.gpu.available else f"absent ({self.gpu.reason})",
        }
        if reading["gpu"]:
            reading["gpu_ecc_errors"] = reading["gpu"]["ecc_errors"]
        if self.config.endpoint_url:
            ep = probe_endpoint(self.config.endpoint_url, self.config.endpoint_timeout_s)
            reading.update(endpoint_up=ep.up, endpoint_latency_s=ep.latency_s if ep.up else float("inf"),
                           endpoint_error=ep.error or (None if ep.up else f"HTTP {ep.status}"))
        return reading

    def sample(self) -> dict:
        """Take one reading, evaluate the thresholds, run the actions. Returns the reading."""
        reading = self.read()
        with self._lock:
            self.latest = reading
        if self.metrics is not None:
            self.metrics.observe(self.task_id, reading)
        if self.on_sample is not None:
            self.on_sample(reading)
        for alert in self._evaluate(reading):
            self._act(alert)
        return reading

    def _evaluate(self, reading: dict) -> list[Alert]:
        fired = []
        leak = self.leaks.check()
        for metric, th in self.config.thresholds.items():
            value = reading.get(metric)
            if th is None or value is None:
                continue
            if metric.startswith("rss_growth"):
                crossed = leak is not None and leak.rule == metric
            elif metric in FLOOR_METRICS:
                crossed = value < th.limit
            else:
                crossed = value > th.limit
            streak = self._streak.get(metric, 0)
            if not crossed:
                if streak:
                    self.on_event("threshold_cleared", {"metric": metric, "value": _finite(value), "limit": th.limit})
                self._streak[metric] = 0
                continue
            self._streak[metric] = streak + 1
            if streak == 0:
                self.on_event("threshold_crossed", {"metric": metric, "value": _finite(value), "limit": th.limit})
            last = self._last_action.get(metric)
            if self._streak[metric] >= th.sustain and (last is None or reading["t"] - last >= th.cooldown_s):
                self._last_action[metric] = reading["t"]
                detail = {"tau": leak.tau, "window_s": leak.span_s} if metric.startswith("rss_growth") else {}
                fired.append(Alert(metric, value, th.limit, th.action, detail))
        return fired

    def _act(self, alert: Alert):
        self.alerts.append(alert)
        if self.metrics is not None:
            self.metrics.alerts.labels(task=self.task_id, metric=alert.metric, action=alert.action.value).inc()
        handler = self.handlers.get(alert.action)
        outcome = "no handler"
        if handler is not None:
            try:
                outcome = handler(alert) or "done"
            except Exception as exc:  # an action failing must not kill the monitor
                outcome = f"failed: {type(exc).__name__}: {exc}"
        self.on_event("monitor_action", {**alert.to_dict(), "outcome": outcome})
        if alert.action is Action.RESTART_TREE:
            self.leaks.reset()  # the restarted tree starts a new history

    # -- background thread ----------------------------------------------------------------------
    def start(self) -> "ResourceMonitor":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"monitor-{self.task_id}", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # keep watching; report the failure
                self.on_event("monitor_error", {"error": f"{type(exc).__name__}: {exc}"})
            self._stop.wait(self.config.interval_s)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.config.interval_s))
            self._thread = None

    def status(self) -> dict:
        """The latest readings, JSON-safe, for the task status."""
        with self._lock:
            return {k: _finite(v) for k, v in self.latest.items()}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
