"""Failures the recovery ladder sees, and the classification of exceptions into error classes."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

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
        import httpx
    except ImportError:
        return False
    return isinstance(exc, (httpx.TimeoutException, httpx.TransportError))
