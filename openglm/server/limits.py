"""Connection, body and queue limits: what clients may cost the server before a request is refused.

`max_queue` caps the requests in flight (the AsyncEngine answers 503 + Retry-After beyond it).

`BodyLimit` is a pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would hide client
disconnects): a declared Content-Length over the cap is refused with 413 before a byte of the body
is read, a chunked body is counted as it arrives, and a body that trickles in slower than
`body_timeout_s` per chunk is refused with 408. The header timeout is a uvicorn protocol subclass:
uvicorn itself only times out idle keep-alive connections, not a client that never finishes its
request line and headers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class ServerLimits:
    max_body_bytes: int = 4 << 20  # request bodies above this are refused with 413
    body_timeout_s: float = 30.0  # the most seconds between two chunks of a request body (408)
    header_timeout_s: float = 10.0  # a connection must send a full request head within this
    keep_alive_s: int = 5  # idle keep-alive connections close after this (uvicorn's timeout_keep_alive)
    limit_concurrency: int = 1024  # connections + tasks beyond this get 503 (uvicorn's limit_concurrency)
    max_queue: int = 256  # requests in flight (queued or running) beyond which new ones get 503 + Retry-After

    def __post_init__(self):
        for name in ("max_body_bytes", "body_timeout_s", "header_timeout_s", "keep_alive_s", "limit_concurrency",
                     "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ServerLimits.{name} must be positive, got {value!r}")


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_too_large" if status == 413 else "request_timeout"}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        cap = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            return await _refuse(send, 413, f"the request body is larger than this server's limit of {cap} bytes")
        chunks, size = [], 0
        while True:  # read the (capped) body here, so that a slow or oversized one never reaches a handler
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                return await _refuse(send, 408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout_s:g} s")
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > cap:
                return await _refuse(send, 413, f"the request body is larger than this server's limit of {cap} bytes")
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


def uvicorn_config(app, host: str, port: int, limits: ServerLimits, log_level: str = "info"):

    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=header_timeout_protocol(limits.header_timeout_s),
                          timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.limit_concurrency,
                          h11_max_incomplete_event_size=64 << 10)  # request line + headers: at most 64 KiB
