"""The resource monitor: samples a task's process tree and the machine, acts on thresholds.

Each sample is a flat dict of readings (shown in the task status and exported to Prometheus).
A reading that crosses its threshold for `sustain` samples in a row fires the threshold's action
(at most once per `cooldown_s`); crossings, clearings and actions are reported as events. What it
reads is in `process_tree` and `probes`, how it tells a leak from a spike in `leak`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psutil

from .config import FLOOR_METRICS, Action, MonitorConfig
from .leak import LeakDetector
from .probes import Gpu, cpu_count, disk_free, probe_endpoint
from .process_tree import ProcessTree


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
