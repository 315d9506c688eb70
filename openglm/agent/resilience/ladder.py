"""The five-level recovery ladder as a state machine.

A failure episode starts at the first failure after a success. Each failure asks the ladder for a
decision: the lowest level of the error class's policy, not below the level already reached in
this episode, that still has attempts left (L1 retry with backoff, L2 alternative, L3 rollback to
the last green snapshot, L4 re-plan, L5 ask a human). A success ends the episode and resets it.
The state is a plain dict so a paused task resumes with its ladder in another process.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from .config import LadderConfig, LadderPolicy, Level
from .errors import Failure, classify


@dataclass
class Decision:
    level: Level
    error_class: str
    attempt: int  # 1-based attempt at this level within the episode
    cause: str
    delay_s: float = 0.0  # L1: wait this long before retrying
    question: str | None = None  # L5: what the human is asked

    def to_dict(self) -> dict:
        d = asdict(self)
        d["level"] = int(self.level)
        return d


class RecoveryLadder:
    def __init__(self, config: LadderConfig | None = None, on_event: Callable[[str, dict], None] | None = None,
                 metrics=None, task_id: str = "task"):
        self.config = config or LadderConfig()
        self.on_event = on_event or (lambda kind, data: None)
        self.metrics, self.task_id = metrics, task_id
        self.floor = 0  # highest level reached in this episode
        self.attempts: dict[int, int] = {}
        self.pending: dict | None = None  # the last decision, outcome not yet known
        self.history: list[dict] = []  # every escalation with its outcome

    # -- transitions ----------------------------------------------------------------------------
    def on_failure(self, failure: Failure | BaseException, *, can_rollback: bool = True) -> Decision:
        if isinstance(failure, BaseException):
            failure = classify(failure)
        self._close("failed")
        policy = self.config.policy(failure.error_class)
        level, attempt = self._next_level(policy, can_rollback)
        decision = Decision(level, failure.error_class, attempt, cause=failure.message)
        if level is Level.RETRY:
            decision.delay_s = min(policy.backoff_max_s, policy.backoff_s * 2 ** (attempt - 1))
        if level is Level.HUMAN:
            decision.question = self._question(failure)
        self.pending = {**decision.to_dict(), "at": time.time()}
        if self.metrics is not None:
            self.metrics.escalations.labels(task=self.task_id, level=f"L{int(level)}",
                                            error_class=failure.error_class).inc()
        self.on_event("recovery_escalation", {**decision.to_dict(), "detail": failure.detail})
        return decision

    def on_success(self):
        """The step (or call) succeeded: record the outcome and end the episode."""
        self._close("recovered")
        self.floor, self.attempts = 0, {}

    def on_answer(self, answer: str):
        """A human answered the L5 question: the task resumes with a fresh ladder."""
        self._close("answered", answer=answer)
        self.floor, self.attempts = 0, {}

    def abort(self, outcome: str):
        """The episode ends without recovery at this layer (e.g. handed to a safe pause)."""
        self._close(outcome)
        self.floor, self.attempts = 0, {}

    def _next_level(self, policy: LadderPolicy, can_rollback: bool) -> tuple[Level, int]:
        for level in policy.levels:
            if level < self.floor or level is Level.HUMAN:
                continue
            if level is Level.ROLLBACK and not can_rollback:
                continue
            used = self.attempts.get(int(level), 0)
            if used < self._limit(level, policy):
                self.attempts[int(level)] = used + 1
                self.floor = int(level)
                return level, used + 1
        # L5 is always the last resort, whatever the policy lists
        used = self.attempts.get(int(Level.HUMAN), 0) + 1
        self.attempts[int(Level.HUMAN)] = used
        self.floor = int(Level.HUMAN)
        return Level.HUMAN, used

    @staticmethod
    def _limit(level: Level, policy: LadderPolicy) -> int:
        return {Level.RETRY: policy.retries, Level.ALTERNATIVE: policy.alternatives,
                Level.ROLLBACK: policy.rollbacks, Level.REPLAN: policy.replans}[level]

    def _close(self, outcome: str, **extra):
        if self.pending is None:
            return
        record = {**self.pending, "outcome": outcome, **extra}
        self.history.append(record)
        self.pending = None
        self.on_event("recovery_outcome", {"level": record["level"], "error_class": record["error_class"],
                                           "outcome": outcome})

    @staticmethod
    def _question(failure: Failure) -> str:
        return (f"The task is stuck on a {failure.error_class.replace('_', ' ')} failure that retries, "
                f"alternatives, rollback and re-planning did not fix: {failure.message[:300]!r}. "
                "How should it proceed (a hint, a different approach, or 'cancel')?")

    # -- persistence ----------------------------------------------------------------------------
    def state(self) -> dict:
        return {"floor": self.floor, "attempts": {str(k): v for k, v in self.attempts.items()},
                "pending": self.pending, "history": self.history[-100:]}

    def load(self, state: dict) -> "RecoveryLadder":
        self.floor = int(state.get("floor", 0))
        self.attempts = {int(k): int(v) for k, v in state.get("attempts", {}).items()}
        self.pending = state.get("pending")
        self.history = list(state.get("history", []))
        return self
