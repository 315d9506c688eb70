"""The OpenAI-compatible server's limits: the HTTP ones every openglm app has (openglm.util.http_limits:
body cap and deadlines, header timeout, keep-alive, concurrency) plus `max_queue`, the requests in
flight (the AsyncEngine answers 503 + Retry-After beyond it). Refusals are OpenAI-style errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from openglm.util import http_limits
from openglm.util.http_limits import HTTPLimits, header_timeout_protocol, uvicorn_config

__all__ = ["BodyLimit", "ServerLimits", "header_timeout_protocol", "uvicorn_config"]


@dataclass
class ServerLimits(HTTPLimits):
    max_queue: int = 256  # requests in flight (queued or running) beyond which new ones get 503 + Retry-After

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue <= 0:
            raise ValueError(f"ServerLimits.max_queue must be positive, got {self.max_queue!r}")


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large" if status == 413 else "request_timeout"}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit(http_limits.BodyLimit):
    def __init__(self, app, limits: HTTPLimits):
        super().__init__(app, limits, _refuse)
