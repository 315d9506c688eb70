"""Stuck detection: an agent repeating itself is a failure for the ladder, not a reason to burn tokens.

Signals (each names the looping steps so they can be condensed out of the context): identical
action/observation pairs in a row, identical errors in a row, an alternating cycle (A B A B A B,
period 2..max_period), no workspace change for N steps, repeated context-limit errors.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass

from openglm.agent.tools import CONTROL_TOOLS

from .config import StuckConfig


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
                  if not o.get("ok", True) and o["name"] not in CONTROL_TOOLS]
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
