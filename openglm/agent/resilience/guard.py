"""The resilience layer inside one run of a task: what happens after each committed step.

A step *fails* when verification breaks (L3 first: back to the last green snapshot), when the agent
loops (stuck detection), or when `failure_streak` steps in a row had a failing tool call (a failing
approach). A failure asks the ladder for a decision, which is carried out here: L2 tells the model
to use an alternative, L3 rolls the workspace back, L4 asks for a new plan (the goal tree lives in
the log as `plan` events), L5 stops the task in NEEDS_INPUT with a question. Everything is an event,
and the ladder/plan state is logged (`resilience_state`) so a resumed run, in any process, continues.

Also in this module:

- Stuck detection: an agent repeating itself is a failure for the ladder, not a reason to burn tokens.

  Signals (each names the looping steps so they can be condensed out of the context):
  identical action/observation pairs in a row, identical errors in a row, an alternating cycle
  (A B A B A B, period 2..max_period), no workspace change for N steps, repeated context-limit errors.

- Budgets: wall clock (the task's timeout), tokens and cost, raisable while a task runs or is paused.

  Wall-clock time counts while the task runs: a paused task (waiting for a human, or for a raise of
  its budget) does not spend it. The state is a plain dict, so it survives a resume in another process.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass

from openglm.agent.store import LeaseLost

from .config import BudgetConfig, Level, ResilienceConfig, StuckConfig
from .ladder import Decision, Failure, GoalTree, RecoveryLadder, parse_plan
from .monitor import Parallelism


CONTROL = {"submit", "ask_user", "_no_action"}  # the runtime's own tools: not work the agent repeats


@dataclass
class StepDigest:
    """What stuck detection compares of a committed step (the runtime's `agent.hooks.StepRecord`)."""

    index: int
    action: str
    observation: str = ""
    error: str | None = None
    workspace_changed: bool = False
    context_limit: bool = False

    @classmethod
    def of(cls, record) -> "StepDigest":
        response = record.response
        action = json.dumps([(c.name, c.arguments) for c in getattr(response, "tool_calls", [])] or
                            getattr(response, "content", ""), sort_keys=True, default=str)
        obs = "\n".join(str(o.get("output", "")) for o in record.observations)
        errors = [str(o.get("output", ""))[-300:] for o in record.observations
                  if not o.get("ok", True) and o["name"] not in CONTROL]
        context_limit = any("context" in e.lower() and "limit" in e.lower() for e in errors)
        return cls(record.step, action, obs, errors[0] if errors else None, record.changed, context_limit)


@dataclass
class StuckSignal:
    kind: str  # repeated_pair | repeated_error | cycle | no_progress | context_limit
    steps: list[int]  # the looping steps
    detail: str

    @property
    def error_class(self) -> str:
        return "context_limit" if self.kind == "context_limit" else "stuck"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "steps": self.steps, "detail": self.detail}


def _norm(text: str) -> str:
    # Timestamps, durations and pids differ between otherwise identical observations and errors.
    return re.sub(r"\d+(\.\d+)?", "#", " ".join((text or "").split()))


def _key(step: StepDigest) -> tuple[str, str]:
    # Actions compare exactly (`echo 1` and `echo 2` are different work); observations without numbers.
    return " ".join(step.action.split()), _norm(step.observation)


class StuckDetector:
    def __init__(self, config: StuckConfig | None = None):
        self.config = config or StuckConfig()
        c = self.config
        keep = max(c.repeat_pairs, c.repeat_errors, c.cycle_repeats * c.max_period, c.context_limit_errors)
        self.recent: deque[StepDigest] = deque(maxlen=keep)
        self.unchanged: list[int] = []  # steps since the last workspace change

    def reset(self):
        self.recent.clear()
        self.unchanged = []

    def observe(self, step: StepDigest) -> StuckSignal | None:
        """Feed one finished step; returns a signal (and forgets the loop) when the agent is stuck."""
        self.recent.append(step)
        self.unchanged = [] if step.workspace_changed else self.unchanged + [step.index]
        signal = (self._context_limit() or self._repeated_error() or self._repeated_pair()
                  or self._cycle() or self._no_progress())
        if signal is not None:
            self.reset()
        return signal

    def _tail(self, n: int) -> list[StepDigest]:
        return list(self.recent)[-n:] if len(self.recent) >= n else []

    def _repeated_pair(self):
        tail = self._tail(self.config.repeat_pairs)
        keys = {_key(s) for s in tail}
        if tail and len(keys) == 1:
            return StuckSignal("repeated_pair", [s.index for s in tail],
                               f"the same action and observation {len(tail)} times: {tail[0].action[:120]!r}")

    def _repeated_error(self):
        tail = self._tail(self.config.repeat_errors)
        if tail and all(s.error for s in tail) and len({_norm(s.error) for s in tail}) == 1:
            return StuckSignal("repeated_error", [s.index for s in tail],
                               f"the same error {len(tail)} times: {tail[0].error[:200]!r}")

    def _cycle(self):
        for period in range(2, self.config.max_period + 1):
            tail = self._tail(period * self.config.cycle_repeats)
            if not tail:
                continue
            keys = [_key(s) for s in tail]
            if len(set(keys[:period])) > 1 and all(keys[i] == keys[i % period] for i in range(len(keys))):
                return StuckSignal("cycle", [s.index for s in tail],
                                   f"a cycle of {period} actions repeated {self.config.cycle_repeats} times")

    def _no_progress(self):
        if len(self.unchanged) >= self.config.no_change_steps:
            return StuckSignal("no_progress", list(self.unchanged),
                               f"no workspace change for {len(self.unchanged)} steps")

    def _context_limit(self):
        tail = self._tail(self.config.context_limit_errors)
        if tail and all(s.context_limit for s in tail):
            return StuckSignal("context_limit", [s.index for s in tail],
                               f"{len(tail)} context-limit errors in a row")


def condense_loop(turns: list, loop_steps: list[int], step_of, summary) -> list:
    """Drop the turns of the looping steps from a context, leaving one summary turn in their place.

    step_of(turn) -> step index or None; summary: the turn that replaces them. The first looping
    turn is kept (the model should see what it tried, once), the repeats go.
    """
    drop = set(loop_steps[1:])
    out, placed = [], False
    for turn in turns:
        step = step_of(turn)
        if step in drop:
            if not placed:
                out.append(summary)
                placed = True
            continue
        out.append(turn)
    return out


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



class Guard:
    def __init__(self, ctx, config: ResilienceConfig, metrics=None):
        self.ctx, self.config, self.metrics = ctx, config, metrics
        # Two ladders: one for a single model/tool call (L1 retry, L2 fallback), one for steps. A call
        # that succeeds after retries must not reset the escalation of a failing approach.
        self.ladder = RecoveryLadder(config.ladder, on_event=self.event, metrics=metrics, task_id=ctx.task_id)
        self.call_ladder = RecoveryLadder(config.ladder, on_event=self.event, metrics=metrics, task_id=ctx.task_id)
        self.stuck = StuckDetector(config.stuck)
        self.parallelism = Parallelism(config.guard.parallelism)
        self.plan = GoalTree(ctx.store.get_task(ctx.task_id).objective)
        self.last_green: int | None = None  # step whose snapshot passed verification
        self.awaiting_plan = ""  # the failure an L4 re-plan is about
        self.streak = 0  # consecutive failing steps
        self.prefer_fallback = False  # the monitor saw the primary endpoint down
        self.restart: dict | None = None  # the monitor killed the running command (a leak)
        self.lock = threading.Lock()

    def start(self):
        """At the start of a run (the state is rebuilt): restore our state, verify the starting point."""
        self._restore()
        cmd = self.config.guard.verify_command
        if cmd and self.last_green is None:
            result = self.ctx.toolbox.call("bash", {"command": cmd}, timeout=self.config.guard.verify_timeout_s)
            self.event("verification", {"step": self.ctx.state.step, "ok": result.ok, "command": cmd,
                                        "output": result.output[-500:]})
            if result.ok:
                self.last_green = self.ctx.state.step
            self.save()

    # -- events and persistence -------------------------------------------------------------------
    def event(self, kind: str, data: dict):
        try:
            self.ctx.log(kind, json.loads(json.dumps(data, default=str)))
        except LeaseLost:  # the run is over (finished, or another worker took over): nothing to record
            pass

    def _restore(self):
        answered = False
        for e in self.ctx.store.all_events(self.ctx.task_id):
            if e.kind == "resilience_state":
                self.ladder.load(e.data["ladder"])
                self.plan = GoalTree.from_dict(e.data["plan"])
                self.last_green, self.awaiting_plan = e.data.get("last_green"), e.data.get("awaiting_plan", "")
                answered = None
            elif e.kind == "answer" and answered is None:
                answered = e.data.get("answer", "")
        if answered:  # the L5 question was answered: a fresh ladder
            self.ladder.on_answer(answered)
            self.save()

    def save(self):
        self.event("resilience_state", {"ladder": self.ladder.state(), "plan": self.plan.to_dict(),
                                        "last_green": self.last_green, "awaiting_plan": self.awaiting_plan})

    def guide(self, text: str):
        """A message to the model, in the live context and (as a `guidance` event) in the log."""
        self.ctx.state.apply("guidance", {"content": text})
        self.event("guidance", {"content": text})

    # -- after each committed step ----------------------------------------------------------------
    def on_step(self, ctx, record):
        if ctx.store.get_task(ctx.task_id).worker != ctx.worker:
            return  # this step ended the task (committed with it) or the lease is gone
        with self.lock:
            restart, self.restart = self.restart, None
        if restart is not None:
            self._restart_from_snapshot(record, restart)
        if self.awaiting_plan:
            self._take_plan(record)
        failure = self._verify(record)
        failing_calls = [o for o in record.observations if not o.get("ok", True) and o["name"] not in CONTROL]
        self.streak = self.streak + 1 if failing_calls else 0
        signal = self.stuck.observe(StepDigest.of(record))
        if signal is not None:
            self.event("stuck", signal.to_dict())
            if self.metrics is not None:
                self.metrics.stuck.labels(task=ctx.task_id, kind=signal.kind).inc()
            repeats = [s for s in signal.steps[1:] if s in ctx.state.steps]
            if repeats:  # the repeats go out of the context; the first attempt stays
                ctx.state.apply("loop_condensed", {"steps": repeats})
                self.event("loop_condensed", {"steps": repeats, "kind": signal.kind})
            failure = failure or Failure(signal.error_class, signal.detail, {"stuck": signal.kind})
        if failure is None and self.streak >= self.config.guard.failure_streak:
            o = failing_calls[0]
            failure = Failure("command_failed", f"{o['name']} failed {self.streak} steps in a row: "
                                                f"{str(o.get('output', ''))[-300:]}")
        if failure is not None:
            self.apply(self.ladder.on_failure(failure, can_rollback=self._green_before(record.step)))
        elif not failing_calls and restart is None:
            self.ladder.on_success()
        self.save()

    def _verify(self, record) -> Failure | None:
        cmd = self.config.guard.verify_command
        if not cmd or not record.changed:
            return None
        result = self.ctx.toolbox.call("bash", {"command": cmd}, timeout=self.config.guard.verify_timeout_s)
        self.event("verification", {"step": record.step, "ok": result.ok, "command": cmd,
                                    "output": result.output[-500:]})
        if result.ok:
            self.last_green = record.step
            return None
        return Failure("verification_failed", f"`{cmd}` failed after step {record.step}: {result.output[-300:]}",
                       {"step": record.step})

    def _green_before(self, step: int) -> bool:
        return self.last_green is not None and self.last_green < step and self.last_green in self.ctx.state.steps

    def _take_plan(self, record):
        items = parse_plan(getattr(record.response, "content", "") or "")
        if items:
            self.plan.replan(self.awaiting_plan, items)
            self.event("replan", {"failure": self.awaiting_plan, "subgoals": items, "revision": self.plan.revision,
                                  "plan": self.plan.render()})
            self.awaiting_plan = ""

    def _restart_from_snapshot(self, record, alert: dict):
        earlier = [s for s in self.ctx.state.steps if s < record.step]
        to = max(earlier) if earlier else record.step
        if to != record.step:
            self.ctx.rollback(to)
        self.event("restart", {"step": record.step, "restored_step": to, **alert})
        self.guide(f"The command of step {record.step} was killed and the workspace restored to step {to}: its "
                   f"memory grew at {alert.get('value', 0) * 60 / 2**20:.1f} MB/min (a leak). Avoid or fix the leak.")

    # -- carrying out a decision ----------------------------------------------------------------
    def apply(self, d: Decision):
        cause = d.cause[:500]
        if d.level is Level.RETRY or d.level is Level.ALTERNATIVE:
            self.guide(f"Recovery (L{int(d.level)}, attempt {d.attempt}): {cause}\nDo not repeat the same thing: "
                       "reach the same goal with a different command, tool or approach.")
        elif d.level is Level.ROLLBACK:
            self.ctx.rollback(self.last_green)
            self.guide(f"Recovery (L3): the workspace was rolled back to step {self.last_green}, the last one whose "
                       f"verification passed. What broke it: {cause}")
        elif d.level is Level.REPLAN:
            self.awaiting_plan = cause
            self.guide(f"Recovery (L4, re-plan): the current approach failed: {cause}\nCurrent plan:\n"
                       f"{self.plan.render()}\nReply with a new plan as a list of subgoals (lines starting with "
                       "'- '), built around this failure, then continue with its first subgoal.")
        else:
            self.ctx.request_input(d.question)
        self.event("recovery_action", {"level": int(d.level), "attempt": d.attempt, "error_class": d.error_class})

