"""Connection, body and queue limits: what clients may cost the server before a request is refused.

- Heads: a connection must send a complete request head within `header_timeout_s` of connecting (or of its
  previous response), in total: uvicorn itself only times out idle keep-alive connections (slow-loris).
- Bodies (`BodyLimit`, a pure ASGI middleware: Starlette's BaseHTTPMiddleware would hide client
  disconnects): a declared Content-Length over `max_body_bytes` is refused with 413 before a byte of the
  body is read, a chunked body is counted as it arrives, and the whole body must arrive within
  `body_timeout_s` plus one second per `min_body_rate` bytes received (a body trickled a byte at a time
  gets 408 at that deadline, however short its pauses).
- A refused upload is answered in a way ordinary clients read: after the response the server half-closes
  and keeps reading and discarding what the client still sends, for at most `LINGER_S` seconds and
  `LINGER_BYTES` bytes, before it closes (nginx's lingering close). Closing at once would make the client's
  kernel see unread data and reset the connection, and urllib or requests report the reset, not the 413.
- Ready requests and connections are counted apart: `limit_concurrency` caps the requests whose body has
  arrived and that are being answered (503 + Retry-After beyond it); `max_connections` caps open
  connections, and a connection beyond it makes room by closing the one that has waited longest without a
  complete request (a slow head or body, an idle keep-alive connection). Slow or idle connections
  therefore never take the places of requests that are ready.
- `max_queue` caps the engine requests in flight (the AsyncEngine answers 503 + Retry-After beyond it).
- Preparing a request (rendering the chat template, tokenising, compiling an output grammar) runs in
  `prepare_workers` worker processes with budgets (`template_timeout_s`, `grammar_timeout_s`):
  `server/prepare.py`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 5.0  # after refusing an upload: the most seconds spent reading and discarding the rest
LINGER_BYTES = 64 << 20  # ... and the most bytes
RETRY_AFTER_S = 1


@dataclass
class ServerLimits:
    max_body_bytes: int = 4 << 20  # request bodies above this are refused with 413
    body_timeout_s: float = 30.0  # a whole request body must arrive within this (plus time at min_body_rate)
    min_body_rate: int = 64 << 10  # bytes per second a body is granted beyond body_timeout_s
    header_timeout_s: float = 10.0  # a connection must send a full request head within this
    keep_alive_s: int = 5  # idle keep-alive connections close after this (uvicorn's timeout_keep_alive)
    limit_concurrency: int = 1024  # requests being answered (body received) beyond which new ones get 503
    max_connections: int = 1024  # open connections; beyond it the longest-waiting not-ready one is closed
    max_queue: int = 256  # requests in flight (queued or running) beyond which new ones get 503 + Retry-After
    prepare_workers: int = 2  # worker processes that render templates, tokenise and check grammars
    template_timeout_s: float = 2.0  # the most seconds one request's chat template may render for (400)
    grammar_timeout_s: float = 5.0  # the most seconds one request's output grammar may compile for (400)

    def __post_init__(self):
        for name in ("max_body_bytes", "body_timeout_s", "min_body_rate", "header_timeout_s", "keep_alive_s",
                     "limit_concurrency", "max_connections", "max_queue", "prepare_workers", "template_timeout_s",
                     "grammar_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerLimits.{name} must be positive, got {value!r}")


ERROR_CODES = {408: "request_timeout", 413: "request_too_large", 503: "server_busy"}


async def _refuse(send, status: int, message: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": ERROR_CODES[status]}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    else:  # the body was not read: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Reads (and caps) a request's body before any handler sees it, and counts the requests being answered."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits
        self.active = 0  # requests past their body, being answered

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        if self.active >= self.limits.limit_concurrency:
            return await _refuse(send, 503, f"the server is answering {self.limits.limit_concurrency} requests "
                                            f"already; retry later")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notifications

        self.active += 1
        try:
            return await self.app(scope, replay, send)
        finally:
            self.active -= 1

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once a refusal is sent (or the client left)."""
        limits, cap = self.limits, self.limits.max_body_bytes
        too_large = f"the request body is larger than this server's limit of {cap} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            await _refuse(send, 413, too_large)
            return None
        loop = asyncio.get_running_loop()
        start, chunks, size = loop.time(), [], 0
        while True:
            left = start + limits.body_timeout_s + size / limits.min_body_rate - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                await _refuse(send, 408, f"the request body did not arrive in time ({limits.body_timeout_s:g} s, "
                                         f"plus 1 s per {limits.min_body_rate} bytes received)")
                return None
            if message["type"] == "http.disconnect":
                return None
            size += len(message.get("body", b""))
            if size > cap:
                await _refuse(send, 413, too_large)
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: closing it while the client is still sending a body
    half-closes instead, and the protocol discards what still arrives for a bounded time and size."""

    def __init__(self, raw, protocol: "H11Protocol"):
        self._raw, self._protocol = raw, protocol
        self.lingering = False

    def close(self) -> None:
        if self.lingering:
            return
        if self._protocol.conn.their_state is h11.SEND_BODY and not self._raw.is_closing():
            self.lingering = True
            self._protocol.linger()
        else:
            self._raw.close()

    def is_closing(self) -> bool:
        return self.lingering or self._raw.is_closing()

    def __getattr__(self, name):
        return getattr(self._raw, name)


def connection_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the head deadline, lingering close and the connection cap above."""

    class GuardedProtocol(H11Protocol):
        _head_timer = _linger_timer = None
        _linger_left = 0
        waiting_since = 0.0  # since when this connection has been without a ready request

        # ---- the connection cap --------------------------------------------------------------------
        def waiting(self) -> bool:
            """Not answering a ready request: waiting for a head or a body, idle, or lingering."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _open(self) -> list:
            """The server's connections that are not closing (a closed one leaves the set a moment later)."""
            return [c for c in self.connections if c.transport is not None and not c.transport_raw().is_closing()]

        def _make_room(self) -> None:
            others = [c for c in self._open() if c is not self and c.waiting()]
            victim = min(others, key=lambda c: c.waiting_since) if others else self
            victim.transport_raw().close()

        def transport_raw(self):
            return self.transport._raw if isinstance(self.transport, _LingeringTransport) else self.transport

        # ---- the head deadline ---------------------------------------------------------------------
        def _arm(self) -> None:
            self._disarm()
            self.waiting_since = self.loop.time()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        # ---- lingering close -----------------------------------------------------------------------
        def linger(self) -> None:
            raw = self.transport_raw()
            if raw.can_write_eof():
                raw.write_eof()  # the client reads the response, then end of stream
            raw.resume_reading()
            self._linger_left = LINGER_BYTES
            self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

        # ---- asyncio.Protocol ----------------------------------------------------------------------
        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            self._arm()
            if len(self.connections) > limits.max_connections and len(self._open()) > limits.max_connections:
                self._make_room()

        def data_received(self, data: bytes) -> None:
            if isinstance(self.transport, _LingeringTransport) and self.transport.lingering:
                self._linger_left -= len(data)  # discarded
                if self._linger_left <= 0:
                    self.transport_raw().close()
                return
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            super().data_received(data)
            if waiting_for_head and self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request head arrived

        def eof_received(self):
            if isinstance(self.transport, _LingeringTransport) and self.transport.lingering:
                self.transport_raw().close()  # the client has sent everything: done lingering
            return super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

    return GuardedProtocol


def uvicorn_config(app, host: str, port: int, limits: ServerLimits, log_level: str = "info"):
    # limit_concurrency stays off in uvicorn: it counts every connection, slow and idle ones too
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=connection_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_s,
                          h11_max_incomplete_event_size=64 << 10)  # request line + headers: at most 64 KiB
