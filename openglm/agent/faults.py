"""Crash points for the kill test: `OPENGLM_CRASH_AT=K` SIGKILLs this process at its K-th crash point.

The step protocol calls `crashpoint(name)` at every boundary that matters (between the model
response and the action, between tool calls, inside a store transaction, between `git add` and
the tree write, ...). With the variable unset a crash point is a no-op. `OPENGLM_CRASH_TRACE=path`
appends the name of each point reached, so a test can count them.
"""

from __future__ import annotations

import os
import signal

_target = int(os.environ.get("OPENGLM_CRASH_AT", "0") or 0)
_trace = os.environ.get("OPENGLM_CRASH_TRACE", "")
_hits = 0


def crashpoint(name: str) -> None:
    global _hits
    if not _target and not _trace:
        return
    _hits += 1
    if _trace:
        with open(_trace, "a") as f:
            f.write(name + "\n")
    if _hits == _target:
        os.kill(os.getpid(), signal.SIGKILL)
