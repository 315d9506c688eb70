"""L1/L2 around one call (a model request, a command): retry with backoff, then the alternatives.

Higher levels (rollback, re-plan, human) change the task, not the call: they are raised as
`Escalation` for the step loop to carry out.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from .config import Level
from .errors import classify
from .ladder import Decision, RecoveryLadder


class Escalation(Exception):
    """The ladder decided on L3..L5: the step loop must roll back, re-plan or ask a human."""

    def __init__(self, decision: Decision, error: BaseException):
        super().__init__(f"L{int(decision.level)} ({decision.error_class}): {decision.cause}")
        self.decision, self.error = decision, error


def call_with_recovery(options: Sequence[Callable[[], object]], ladder: RecoveryLadder,
                       sleep: Callable[[float], None] = time.sleep, on_switch: Callable[[int], None] | None = None,
                       can_rollback: bool = True):
    """Call options[0] (the primary); options[1:] are the alternatives (e.g. the fallback model).

    Returns the first result that succeeds. L2's k-th alternative is options[min(k, len-1)].
    """
    current = 0
    while True:
        try:
            result = options[current]()
        except Exception as exc:
            decision = ladder.on_failure(classify(exc), can_rollback=can_rollback)
            if decision.level is Level.RETRY:
                sleep(decision.delay_s)
                continue
            if decision.level is Level.ALTERNATIVE and len(options) > 1:
                current = min(decision.attempt, len(options) - 1)
                if on_switch is not None:
                    on_switch(current)
                continue
            raise Escalation(decision, exc) from exc
        ladder.on_success()
        return result
