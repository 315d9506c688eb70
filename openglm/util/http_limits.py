"""Connection and body limits of openglm's HTTP apps (the OpenAI-compatible server, the agent's task
API): what a client may cost a server before its request is refused.

`BodyLimit` is a pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would hide client
disconnects): a declared Content-Length over the cap is refused with 413 before a byte of the body
is read, a chunked body is counted as it arrives, and a body that trickles in slower than
`body_timeout_s` per chunk (or, with `body_deadline_s`, not whole within that) is refused with 408.
The header timeout is a uvicorn protocol subclass: uvicorn itself only times out idle keep-alive
connections, not a client that never finishes its request line and headers. Each app answers a
refusal in its own format (`refuse`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class HTTPLimits:
    max_body_bytes: int = 4 << 20  # request bodies above this are refused with 413
    body_timeout_s: float = 30.0  # the most seconds between two chunks of a request body (408)
    header_timeout_s: float = 10.0  # a connection must send a full request head within this
    keep_alive_s: int = 5  # idle keep-alive connections close after this (uvicorn's timeout_keep_alive)
    limit_concurrency: int = 1024  # connections + tasks beyond this get 503 (uvicorn's limit_concurrency)
    body_deadline_s: float | None = None  # the whole body must have arrived within this (None: no total)

    def __post_init__(self):
        for name in ("max_body_bytes", "body_timeout_s", "header_timeout_s", "keep_alive_s", "limit_concurrency",
                     "body_deadline_s"):
            value = getattr(self, name)
            if value is None and name == "body_deadline_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive, got {value!r}")


async def refuse_json(send, status: int, message: str) -> None:
    """The default refusal: `{"detail": message}` (FastAPI's error shape)."""
    await send_json(send, status, {"detail": message})


async def send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    def __init__(self, app, limits: HTTPLimits, refuse=refuse_json):
        self.app, self.limits, self.refuse = app, limits, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        cap = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            return await self.refuse(send, 413, f"the request body is larger than this server's limit of {cap} bytes")
        deadline = None if self.limits.body_deadline_s is None else time.monotonic() + self.limits.body_deadline_s
        chunks, size = [], 0
        while True:  # read the (capped) body here, so that a slow or oversized one never reaches a handler
            wait = self.limits.body_timeout_s if deadline is None else min(self.limits.body_timeout_s,
                                                                          deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0))
            except asyncio.TimeoutError:
                limit = (f"{self.limits.body_timeout_s:g} s between chunks" if deadline is None or
                         time.monotonic() < deadline else f"{self.limits.body_deadline_s:g} s in all")
                return await self.refuse(send, 408, f"the request body did not arrive within {limit}")
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > cap:
                return await self.refuse(send, 413,
                                         f"the request body is larger than this server's limit of {cap} bytes")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notifications

        return await self.app(scope, replay, send)


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not sent a complete request head
    `header_timeout_s` after it connected or after its previous response (slow-loris)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            super().data_received(data)
            if waiting_for_head and self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request head arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def uvicorn_config(app, host: str, port: int, limits: HTTPLimits, log_level: str = "info", **options):
    """uvicorn's Config with `limits` applied; `options` are more of its keyword arguments (e.g. access_log)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, **options,
                          http=header_timeout_protocol(limits.header_timeout_s),
                          timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.limit_concurrency,
                          h11_max_incomplete_event_size=64 << 10)  # request line + headers: at most 64 KiB
