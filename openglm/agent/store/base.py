"""The Store interface: tasks, an append-only event log, and worker leases.

Two implementations pass the same test-suite: `SQLiteStore` (embedded default, WAL) and
`RedisStore` (several workers on several machines). Every write that must be atomic (events plus
the task fields they imply, a lease claim) is one transaction / one Lua script.

Fencing: writes made by a worker pass `worker=<id>`; they fail with `LeaseLost` once another worker
owns the task, so a worker that stalled past its lease can never corrupt the task it lost.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from openglm.agent.task import Task


class StoreError(RuntimeError):
    pass


class TaskNotFound(StoreError, KeyError):
    def __init__(self, task_id: str):
        super().__init__(f"no such task: {task_id}")
        self.task_id = task_id

    def __str__(self):  # KeyError would quote the message
        return f"no such task: {self.task_id}"


class StoreUnavailable(StoreError):
    """The store cannot serve the request right now (disk full, locked, unreachable, corrupt page).
    Nothing was written; the caller backs off and retries. `reason` is short ("disk full")."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"store: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


class StoreCorrupt(StoreError):
    """The store's file fails its integrity check; the message says how to recover."""


class LeaseLost(StoreError):
    """The writing worker no longer owns the task."""


class StateConflict(StoreError):
    """The task is not in a state that allows this change."""


@dataclass
class Event:
    seq: int  # 1, 2, ... per task
    kind: str
    step: int = 0
    data: dict = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


def event_json(kind: str, step: int, data: dict, ts: float | None = None) -> str:
    return json.dumps({"kind": kind, "step": step, "data": data, "ts": ts or time.time()}, ensure_ascii=False)


def event_from_json(seq: int, text: str) -> Event:
    d = json.loads(text)
    return Event(seq=seq, kind=d["kind"], step=d["step"], data=d["data"], ts=d["ts"])


class Store:
    """Interface (and shared helpers). Methods raise TaskNotFound / LeaseLost / StateConflict."""

    def create_task(self, task: Task, events: list[tuple[str, int, dict]] = ()) -> Task:
        """Insert a task and its first events in one atomic write (never a task without its log)."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise StoreUnavailable if the store cannot answer now (for /health)."""
        self.event_count("__health__")

    def get_task(self, task_id: str) -> Task:
        raise NotImplementedError

    def list_tasks(self, limit: int = 100, offset: int = 0) -> list[Task]:
        """The newest tasks first, skipping the first `offset`."""
        raise NotImplementedError

    def update_task(self, task_id: str, fields: dict, *, worker: str | None = None,
                    expect_state: set[str] | None = None) -> Task:
        """Change task fields atomically; fenced by `worker`, guarded by `expect_state`."""
        raise NotImplementedError

    def append(self, task_id: str, events: list[tuple[str, int, dict]], fields: dict | None = None,
               *, worker: str | None = None, expect_state: set[str] | None = None) -> list[int]:
        """Append events (kind, step, data) and update task fields in one atomic write; returns seqs."""
        raise NotImplementedError

    def events(self, task_id: str, after: int = 0, limit: int = 1000) -> list[Event]:
        """Events with seq > after, oldest first."""
        raise NotImplementedError

    def event_count(self, task_id: str) -> int:
        raise NotImplementedError

    def claim(self, worker: str, ttl: float) -> Task | None:
        """Atomically take a QUEUED task, or a RUNNING one whose lease expired; None if none."""
        raise NotImplementedError

    def heartbeat(self, task_id: str, worker: str, ttl: float) -> Task:
        """Extend the lease (LeaseLost if another worker owns the task); returns the task."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    # helpers shared by both implementations
    def all_events(self, task_id: str) -> list[Event]:
        out, after = [], 0
        while batch := self.events(task_id, after=after, limit=5000):
            out += batch
            after = batch[-1].seq
        return out

