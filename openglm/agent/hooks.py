"""Extension points for the layers built on the runtime (resilience, policies).

- `model_wrappers`: `wrap(model, ctx) -> Model`, an object around the run's model (a `Model`:
  `query(messages, tools) -> ModelResponse`), e.g. the resilience layer's `ResilientModel` (retries);
  `tool_wrappers`: `wrap(env, ctx) -> Environment` around the run's tools (`call(name, args) ->
  ToolResult`). The first listed is innermost. Wrappers run *before* the write-ahead record, so a
  retried call is still recorded once.
- `step_callbacks`: `cb(ctx, record)` after each committed step (`record` = StepRecord).
- `monitors`: `factory(ctx) -> object with .stop()`, started when a run starts and stopped when it
  ends (e.g. a resource sampler thread writing into `ctx.readings`, which the heartbeat stores).
- `budgets`: `check(ctx) -> reason | None`, called before every step; a reason pauses the task.
- `routes`: `add(app, store)` adds routes to the task API (FastAPI), e.g. raising a task's budget.
- `metrics`: `render() -> bytes` in the Prometheus text format; `GET /metrics` serves them all.
From any of these, `ctx.request_pause(reason)` pauses after the current step, `ctx.rollback(step)`
restores an earlier snapshot, and `ctx.log(kind, data)` appends an event (and applies it to the run's
state: a `guidance` event is a message to the model).
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Hooks:
    model_wrappers: list[Callable] = field(default_factory=list)
    tool_wrappers: list[Callable] = field(default_factory=list)
    step_callbacks: list[Callable] = field(default_factory=list)
    monitors: list[Callable] = field(default_factory=list)
    budgets: list[Callable] = field(default_factory=list)
    routes: list[Callable] = field(default_factory=list)
    metrics: list[Callable] = field(default_factory=list)

    def merge(self, other: "Hooks") -> "Hooks":
        return Hooks(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


def load_hooks(specs: list[str], config: Any = None) -> Hooks:
    """'package.module:factory' -> factory(config) returning Hooks; merged in order."""
    hooks = Hooks()
    for spec in specs:
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"hooks spec {spec!r} must look like 'package.module:factory'")
        hooks = hooks.merge(getattr(importlib.import_module(module), name)(config))
    return hooks


@dataclass
class StepRecord:
    step: int
    response: Any  # ModelResponse
    observations: list[dict]
    snapshot: str
    changed: bool


class RunContext:
    """What hooks and policies may see and do during one run of a task (one worker, one lease)."""

    def __init__(self, run):
        self._run = run
        self.task_id: str = run.task.id
        self.worker: str = run.worker
        self.store = run.store
        self.snapshots = run.snapshots
        self.workspace: str = str(run.snapshots.workspace)
        self.constraints = run.constraints  # the task's parsed Constraints
        self.readings: dict = {}  # resource readings from monitors; stored with each heartbeat
        self.control: str = ""  # latest pause/cancel request seen by the heartbeat
        self.lease_lost = False
        self.pause_reason: str = ""
        self.input_question: str = ""  # set by request_input: the run stops in NEEDS_INPUT
        self.extensions: dict[str, Any] = {}  # per-run state of a hook layer, by its name (e.g. "resilience")
        self._started = time.monotonic()
        self._lock = threading.Lock()

    @property
    def state(self):
        return self._run.state

    @property
    def elapsed_s(self) -> float:
        """Active running time of the task over all its runs."""
        return self._run.task.active_s + time.monotonic() - self._started

    @property
    def remaining_s(self) -> float | None:
        t = self.constraints.timeout_s
        return None if t is None else t - self.elapsed_s

    @property
    def model(self):
        """The run's model as configured, outside the wrappers (a FallbackModel exposes `.primary` and
        `.fallback`)."""
        return self._run.configured_model

    @property
    def toolbox(self):
        """The run's own tools, outside the wrappers: same workspace, limits and timeouts."""
        return self._run.toolbox

    def request_input(self, question: str) -> None:
        """Stop after the current step in NEEDS_INPUT asking `question` (the recovery ladder's L5)."""
        with self._lock:
            self.input_question = self.input_question or question

    def request_pause(self, reason: str) -> None:
        with self._lock:
            self.pause_reason = self.pause_reason or reason

    def rollback(self, step: int) -> str:
        return self._run.rollback(step)

    def log(self, kind: str, data: dict) -> None:
        self._run.log(kind, data)
