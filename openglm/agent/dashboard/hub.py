"""One poller per server feeding every open dashboard: however many browsers watch, the store is
read once per interval (tasks list + new events only); each browser's stream looks at the rows in memory.

It also keeps the history of each task's resource readings (the heartbeat writes only the latest
into the task record) for the resource graphs: up to `HISTORY` samples per task, in memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from openglm.agent.dashboard.digest import Digest, summary

HISTORY = 7200  # samples per task (2 h at the default 1 s heartbeat of a 3 s lease, 10 h at 5 s)
READING_KEYS = ("cpu_percent", "machine_cpu_percent", "rss_bytes", "rss_growth_short", "rss_growth_long",
                "disk_free_bytes", "endpoint_latency_s", "worker_cpu_percent", "worker_rss_bytes", "tools_rss_bytes")


class Hub:
    def __init__(self, store, interval: float = 0.5, limit: int = 500):
        self.store, self.interval, self.limit = store, interval, limit
        self.digests: dict[str, Digest] = {}
        self.rows: dict[str, dict] = {}
        self.stamps: dict[str, int] = {}  # task -> version at which its row last changed
        self.history: dict[str, deque] = {}
        self._seen_updates: dict[str, float] = {}  # task -> updated_at when its events were last read
        self._last_readings: dict[str, dict] = {}
        self.version = 0
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error = ""

    def start(self) -> "Hub":
        with self.lock:
            started = self._thread is not None
            if not started:
                self._thread = threading.Thread(target=self._run, daemon=True, name="dashboard-hub")
        if not started:  # the first caller fills the rows before the poller takes over
            self._refresh_once()
            self._thread.start()
        return self

    def stop(self):
        self._stop.set()

    def _run(self):
        while not self._stop.wait(self.interval):
            self._refresh_once()

    def _refresh_once(self):
        try:
            self.refresh()
            self.error = ""
        except Exception as e:  # a store hiccup: the page shows it; the next round retries
            self.error = f"{type(e).__name__}: {e}"

    def refresh(self) -> None:
        now = time.time()
        changed = {}
        for task in self.store.list_tasks(self.limit):
            digest = self.digests.setdefault(task.id, Digest())
            if task.updated_at != self._seen_updates.get(task.id):  # every append bumps it: else nothing new
                self._seen_updates[task.id] = task.updated_at
                while batch := self.store.events(task.id, after=digest.after, limit=1000):
                    digest.fold(batch)
                    if len(batch) < 1000:
                        break
                if task.resources and task.resources != self._last_readings.get(task.id):
                    self._last_readings[task.id] = task.resources
                    self._record(task.id, task.updated_at, task.resources)
            row = summary(task, digest, now)
            old = self.rows.get(task.id)
            if old is None or _differs(old, row):
                changed[task.id] = row
        if changed:
            with self.lock:
                self.version += 1
                for tid, row in changed.items():
                    self.rows[tid], self.stamps[tid] = row, self.version

    def _record(self, task_id: str, ts: float, readings: dict):
        sample = {"ts": ts, **{k: readings[k] for k in READING_KEYS if isinstance(readings.get(k), (int, float))}}
        self.history.setdefault(task_id, deque(maxlen=HISTORY)).append(sample)

    def changes_since(self, version: int) -> tuple[int, list[dict]]:
        """(the current version, the rows that changed after `version`): an in-memory look, no store access."""
        with self.lock:
            return self.version, [self.rows[t] for t, v in self.stamps.items() if v > version]

    def rows_sorted(self) -> list[dict]:
        with self.lock:
            return sorted(self.rows.values(), key=lambda r: r["created_at"], reverse=True)


def _differs(old: dict, new: dict) -> bool:
    # elapsed time ticks every refresh for a running task: count it as a change only per whole second
    a, b = dict(old), dict(new)
    a["time"], b["time"] = int(old["time"]["elapsed_s"]), int(new["time"]["elapsed_s"])
    return a != b
