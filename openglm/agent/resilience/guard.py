"""The resilience layer inside one run of a task: what happens after each committed step.

A step *fails* when verification breaks (L3 first: back to the last green snapshot), when the agent
loops (stuck detection), or when `failure_streak` steps in a row had a failing tool call (a failing
approach). A failure asks the ladder for a decision, which is carried out here: L2 tells the model
to use an alternative, L3 rolls the workspace back, L4 asks for a new plan (a `replan` event; the
goal tree is logged with the guard's state), L5 stops the task in NEEDS_INPUT with a question. Everything is an event
(the run applies the ones that change the model's context as it logs them), and the ladder/plan state
is logged (`resilience_state`) so a resumed run, in any process, continues.
"""

from __future__ import annotations

import json
import threading

from openglm.agent.store import LeaseLost
from openglm.agent.tools import CONTROL_TOOLS

from .config import Level, ResilienceConfig
from .ladder import Decision, Failure, RecoveryLadder
from .plan import GoalTree, parse_plan
from .stuck import StepDigest, StuckDetector


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


class Guard:
    """The resilience layer's state in one run: two ladders, stuck detection, the plan, verification."""

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
        """A message to the model: a `guidance` event, which the run applies to its context as it logs it."""
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
        failing_calls = [o for o in record.observations
                         if not o.get("ok", True) and o["name"] not in CONTROL_TOOLS]
        self.streak = self.streak + 1 if failing_calls else 0
        signal = self.stuck.observe(StepDigest.of(record))
        if signal is not None:
            self.event("stuck", signal.to_dict())
            if self.metrics is not None:
                self.metrics.stuck.labels(task=ctx.task_id, kind=signal.kind).inc()
            repeats = [s for s in signal.steps[1:] if s in ctx.state.steps]
            if repeats:  # the repeats go out of the context (the event says so); the first attempt stays
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

