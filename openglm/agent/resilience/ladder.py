"""The five-level recovery ladder as a state machine.

A failure episode starts at the first failure after a success. Each failure asks the ladder for a
decision: the lowest level of the error class's policy, not below the level already reached in
this episode, that still has attempts left (L1 retry with backoff, L2 alternative, L3 rollback to
the last green snapshot, L4 re-plan, L5 ask a human). A success ends the episode and resets it.
The state is a plain dict so a paused task resumes with its ladder in another process.

Here too: the failures the ladder sees (exceptions classified into error classes), and `retry_call`,
the runtime's one retry loop: L1 around one call (a model request, a command). Every other decision
is raised as `Escalation` for the layer that carries it out (a FallbackModel's other model at L2,
the guard at L3..L5).
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from .config import LadderConfig, LadderPolicy, Level

# Errors re-raised as text (e.g. the runtime's ModelError) still carry their status or transport failure.
HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
TRANSPORT = re.compile(r"timed? ?out|timeout|connect(ion)? ?(error|refused|reset)|remote ?protocol|"
                       r"server disconnected|temporarily unavailable", re.I)
CONTEXT_LIMIT = re.compile(r"context (length|window|limit)|maximum context|too many tokens|prompt is too long", re.I)


@dataclass
class Failure:
    error_class: str  # a key of LadderConfig.policies
    message: str
    detail: dict = field(default_factory=dict)

    @property
    def signature(self) -> str:
        """The message without numbers/addresses, so 'timeout after 3.02s' repeats as one error."""
        return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "#", self.message.lower()).strip()

    def to_dict(self) -> dict:
        return {"error_class": self.error_class, "message": self.message, **self.detail}


class ClassifiedError(Exception):
    """An exception that already knows its error class (raised by tools, verification, detectors)."""

    def __init__(self, error_class: str, message: str, **detail):
        super().__init__(message)
        self.error_class, self.detail = error_class, detail


def classify(exc: BaseException) -> Failure:
    """Map an exception to a Failure. Transient: timeouts, connection errors, HTTP 429 and 5xx."""
    msg = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ClassifiedError):
        return Failure(exc.error_class, str(exc), dict(exc.detail))
    cls = getattr(exc, "error_class", None)  # duck-typed: the runtime's own errors may carry one
    if isinstance(cls, str):
        return Failure(cls, msg)
    status = _http_status(exc)
    if status is not None:
        if status == 429 or status >= 500:
            return Failure("transient", msg, {"status": status})
        if status == 400 and CONTEXT_LIMIT.search(str(exc)):
            return Failure("context_limit", msg, {"status": status})
        return Failure("command_failed", msg, {"status": status})
    if CONTEXT_LIMIT.search(str(exc)):
        return Failure("context_limit", msg)
    if isinstance(exc, (TimeoutError, ConnectionError, subprocess.TimeoutExpired)) or _is_httpx_transport(exc):
        return Failure("transient", msg)
    if type(exc).__name__ == "ModelError" and TRANSPORT.search(str(exc)):
        return Failure("transient", msg)
    return Failure("command_failed", msg)


def _http_status(exc: BaseException) -> int | None:
    for obj in (exc, getattr(exc, "response", None)):
        status = getattr(obj, "status_code", None) or getattr(obj, "status", None)
        if isinstance(status, int):
            return status
    m = HTTP_STATUS.search(str(exc))
    return int(m.group(1)) if m else None


def _is_httpx_transport(exc: BaseException) -> bool:
    try:
        import httpx  # only to recognise its exception types; the caller has it loaded
    except ImportError:
        return False
    return isinstance(exc, (httpx.TimeoutException, httpx.TransportError))


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


class Escalation(Exception):
    """The ladder decided more than a retry (L2..L5): the caller carries it out (another model, a rollback,
    a re-plan, a question to a human)."""

    def __init__(self, decision: Decision, error: BaseException):
        super().__init__(f"L{int(decision.level)} ({decision.error_class}): {decision.cause}")
        self.decision, self.error = decision, error


def retry_call(call: Callable[[], object], ladder: RecoveryLadder, *, sleep: Callable[[float], None] = time.sleep,
               can_rollback: bool = True, retry_on: tuple[type[BaseException], ...] = (Exception,)):
    """Call `call()`; while a failure (an exception of `retry_on`) gets an L1 decision, wait its backoff
    and call again. A success ends the ladder's episode; any other decision raises `Escalation`."""
    while True:
        try:
            result = call()
        except retry_on as exc:
            decision = ladder.on_failure(classify(exc), can_rollback=can_rollback)
            if decision.level is not Level.RETRY:
                raise Escalation(decision, exc) from exc
            sleep(decision.delay_s)
            continue
        ladder.on_success()
        return result
