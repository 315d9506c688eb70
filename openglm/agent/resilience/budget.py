"""Budgets: wall clock (the task's timeout), tokens and cost, raisable while a task runs or is paused.

Wall-clock time counts while the task runs: a paused task (waiting for a human, or for a raise of
its budget) does not spend it. The state is a plain dict, so it survives a resume in another process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from openglm.agent.task import TERMINAL, ConstraintError, TaskState, parse_constraints

from .config import BudgetConfig

# USD per million tokens (input, output). Local models cost nothing; callers add their providers.
DEFAULT_PRICES: dict[str, tuple[float, float]] = {}


@dataclass
class BudgetExceeded:
    kind: str  # wall_clock | tokens | cost
    used: float
    limit: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, "used": self.used, "limit": self.limit}

    def __str__(self) -> str:
        return f"{self.kind} budget exhausted: used {self.used:g} of {self.limit:g}"


class BudgetTracker:
    def __init__(self, config: BudgetConfig | None = None, prices: dict | None = None,
                 clock=time.monotonic):
        self.config = config or BudgetConfig()
        self.prices = dict(DEFAULT_PRICES if prices is None else prices)
        self.clock = clock
        self.tokens = 0
        self.cost = 0.0
        self.elapsed_before = 0.0  # running time accumulated before the current run
        self._running_since: float | None = None

    # -- accounting -----------------------------------------------------------------------------
    def start(self):
        if self._running_since is None:
            self._running_since = self.clock()

    def stop(self):
        """Pause the wall clock (the task is paused or the worker is giving it up)."""
        if self._running_since is not None:
            self.elapsed_before += self.clock() - self._running_since
            self._running_since = None

    @property
    def elapsed(self) -> float:
        run = self.clock() - self._running_since if self._running_since is not None else 0.0
        return self.elapsed_before + run

    def charge(self, prompt_tokens: int = 0, completion_tokens: int = 0, model: str | None = None,
               cost: float | None = None):
        self.tokens += int(prompt_tokens) + int(completion_tokens)
        if cost is None and model in self.prices:
            price_in, price_out = self.prices[model]
            cost = (prompt_tokens * price_in + completion_tokens * price_out) / 1e6
        self.cost += cost or 0.0

    def exceeded(self) -> BudgetExceeded | None:
        c = self.config
        if c.max_tokens is not None and self.tokens >= c.max_tokens:
            return BudgetExceeded("tokens", self.tokens, c.max_tokens)
        if c.max_cost is not None and self.cost >= c.max_cost:
            return BudgetExceeded("cost", round(self.cost, 6), c.max_cost)
        if c.wall_clock_s is not None and self.elapsed >= c.wall_clock_s:
            return BudgetExceeded("wall_clock", round(self.elapsed, 3), c.wall_clock_s)
        return None

    def raise_caps(self, wall_clock_s: float | None = None, max_tokens: int | None = None,
                   max_cost: float | None = None) -> dict:
        """Raise caps (a cap can only go up: lowering one below use would end the task behind its back)."""
        new = {"wall_clock_s": wall_clock_s, "max_tokens": max_tokens, "max_cost": max_cost}
        for key, value in new.items():
            if value is None:
                continue
            if value <= 0:
                raise ValueError(f"budget {key} must be positive, got {value!r}")
            old = getattr(self.config, key)
            if old is not None and value < old:
                raise ValueError(f"budget {key} can only be raised: {value!r} < current {old!r}")
            setattr(self.config, key, value)
        return self.remaining()

    def remaining(self) -> dict:
        c = self.config
        return {
            "wall_clock_s": None if c.wall_clock_s is None else max(0.0, c.wall_clock_s - self.elapsed),
            "tokens": None if c.max_tokens is None else max(0, c.max_tokens - self.tokens),
            "cost": None if c.max_cost is None else max(0.0, c.max_cost - self.cost),
        }

    # -- persistence ----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"tokens": self.tokens, "cost": self.cost, "elapsed_s": self.elapsed,
                "caps": {"wall_clock_s": self.config.wall_clock_s, "max_tokens": self.config.max_tokens,
                         "max_cost": self.config.max_cost}}

    def load(self, state: dict) -> "BudgetTracker":
        self.tokens = int(state.get("tokens", 0))
        self.cost = float(state.get("cost", 0.0))
        self.elapsed_before, self._running_since = float(state.get("elapsed_s", 0.0)), None
        caps = state.get("caps") or {}
        self.config = BudgetConfig(**{k: caps.get(k, getattr(self.config, k)) for k in
                                      ("wall_clock_s", "max_tokens", "max_cost")})
        return self


_KEYS = {"timeout": "timeout_s", "max_tokens": "max_tokens", "max_cost": "max_cost"}


def raise_budget(store, task_id: str, **caps) -> dict:
    """Set new caps (only upwards); a running task's budget check re-reads them before its next step.

    caps: timeout ("8h", seconds), max_tokens, max_cost. Returns the task's new constraints.
    """
    task = store.get_task(task_id)
    if TaskState(task.state) in TERMINAL:
        raise ConstraintError("state", f"task {task_id} is {task.state}: budgets can be raised only before it ends")
    caps = {k: v for k, v in caps.items() if v is not None}
    unknown = set(caps) - set(_KEYS)
    if unknown or not caps:
        raise ConstraintError("budget", f"give one or more of {sorted(_KEYS)} (got {sorted(caps) or 'none'})")
    old = task.parsed_constraints
    merged = {**task.constraints, **caps}
    new = parse_constraints(merged)  # validates the values, naming the field
    for key, attr in _KEYS.items():
        before, after = getattr(old, attr), getattr(new, attr)
        if key in caps and before is not None and after < before:
            raise ConstraintError(f"constraints.{key}", f"can only be raised: {caps[key]!r} is below the current cap")
    store.append(task_id, [("budget_raised", task.step, {"caps": caps})], {"constraints": merged})
    return merged


def task_over_budget(task, price_per_mtok: tuple[float, float]) -> BudgetExceeded | None:
    """The task's tokens and cost so far against its current caps (`max_tokens`, `max_cost`)."""
    caps = task.parsed_constraints
    price_in, price_out = price_per_mtok
    tracker = BudgetTracker(BudgetConfig(max_tokens=caps.max_tokens, max_cost=caps.max_cost))
    tracker.charge(task.prompt_tokens, task.completion_tokens,
                   cost=(task.prompt_tokens * price_in + task.completion_tokens * price_out) / 1e6)
    return tracker.exceeded()
