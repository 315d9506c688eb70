"""Drive an LLMEngine from a background thread for many concurrent asyncio requests.

Handlers never change the engine: they post commands (add / abort) to a thread-safe queue and read
their outputs from an asyncio.Queue that the engine thread feeds with `call_soon_threadsafe`. The
event loop therefore never waits on a model step, and the engine is only ever stepped by one thread.
Each HTTP request gets one `RequestStream` over the engine requests of all its prompts; it hands on the engine's
outputs with, per choice, what is new since the previous output (the engine reports only that while a request
runs, and the whole output once it finishes).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from openglm.engine.llm_engine import LLMEngine
from openglm.engine.outputs import RequestOutput
from openglm.engine.sampling_params import SamplingParams
from openglm.server.errors import APIError

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1  # the Retry-After a full queue answers with (requests finish within seconds)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, metrics=None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.commands: queue.Queue = queue.Queue()
        self.streams: dict[str, tuple[RequestStream, int]] = {}  # engine request id -> its stream, prompt index
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="openglm-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self.commands.put(("wake",))
        self.thread.join(timeout=10)

    # ---- called from the event loop --------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: list[SamplingParams],
               is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> "RequestStream":
        """Queue one HTTP request's prompts now, all or none (so overload is refused with 503 before any response
        starts), and return the one stream of their outputs."""
        if self.error is not None:
            raise APIError(503, f"the engine has stopped: {self.error}", retry_after=RETRY_AFTER_S)
        if len(self.streams) + len(prompts) > self.max_queue:  # a retry can succeed: check_fits refused the rest
            raise APIError(503, f"the server is at capacity ({self.max_queue} requests in flight); retry later",
                           code="server_busy", retry_after=RETRY_AFTER_S)
        stream = RequestStream(self, asyncio.get_running_loop(), is_disconnected)
        group = f"g{next(self._ids)}"  # the scheduler shares the batch fairly between HTTP requests
        for index, (ids, sp) in enumerate(zip(prompts, params)):
            request_id = f"r{next(self._ids)}"
            stream.request_ids.append(request_id)
            self.streams[request_id] = (stream, index)
            self.commands.put(("add", request_id, ids, sp, group))
        return stream

    def check_fits(self, num_prompts: int) -> None:
        """One request may hold at most half the queue (so that it cannot shut every other client out while it
        runs); more prompts than that can never be admitted: a 400, not a 503."""
        most = max(1, self.max_queue // 2)
        if num_prompts > most:
            raise APIError(400, f"{num_prompts} prompts in one request; this server takes at most {most} per "
                                f"request (half of the {self.max_queue} requests it queues)", param="prompt")

    def release(self, request_id: str) -> None:
        """The consumer is gone: stop the request and free its blocks (idempotent)."""
        if self.streams.pop(request_id, None) is not None:
            self.commands.put(("abort", request_id))

    # ---- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
                if self.metrics is not None:
                    self.metrics.observe_engine(self.engine)
            except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not hang them
                traceback.print_exc()
                self.error = exc
                for rid in list(self.streams):
                    self._send(rid, APIError(500, f"engine failure: {exc}"))
                self._recover()
                self.error = None

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt_ids, params, group = cmd
            if rid not in self.streams:  # the client left before the engine got to it: an abort all the same
                if self.metrics is not None:
                    self.metrics.requests.labels(finish_reason="abort").inc()
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid, group=group)
            except ValueError as exc:  # the prompt (checked before already: not expected)
                self._send(rid, APIError(400, str(exc), param="prompt"))
        elif cmd[0] == "abort":
            self._abort(cmd[1])

    def _step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:  # this request alone failed in the step; the others go on
                if self.metrics is not None:
                    self.metrics.requests.labels(finish_reason="error").inc()
                self._send(out.request_id, APIError(500, f"engine failure in this request: {out.error}"))
                continue
            if out.finished and self.metrics is not None:
                self._record(out)
            self._send(out.request_id, out)

    def _record(self, out: RequestOutput) -> None:
        m, t = self.metrics, out.metrics
        if t.get("first_token_time") is not None:
            m.ttft.observe(t["first_token_time"] - t["arrival_time"])
        m.e2e.observe(time.monotonic() - t["arrival_time"])
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        for c in out.outputs:
            m.observe_itl(t, len(c.token_ids))
            m.gen_tokens.inc(len(c.token_ids))
            m.requests.labels(finish_reason=c.finish_reason or "unknown").inc()

    def _send(self, request_id: str, item) -> None:
        target = self.streams.get(request_id)
        if target is None:
            if not isinstance(item, BaseException) and not getattr(item, "finished", True):
                self._abort(request_id)  # nobody is listening any more
            return
        stream, index = target
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, (index, item))
        except RuntimeError:  # the loop has closed
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id) and self.metrics is not None:
            self.metrics.requests.labels(finish_reason="abort").inc()

    def _recover(self) -> None:
        """After a failed step nothing may hold blocks: abort everything that is left."""
        self.engine.abort_all()


@dataclass
class Delta:
    """What one choice added since the stream's previous output."""

    text: str
    token_ids: list[int]
    logprobs: list[dict]  # empty unless the request asked for logprobs
    offset: int  # characters of the choice's text sent before `text`


class RequestStream:
    """One HTTP request's outputs, from all its prompts, as (prompt index, output, one Delta per choice);
    leaving it early (break, cancellation, client disconnect, an error) aborts whatever is unfinished."""

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop, is_disconnected=None):
        self.engine, self.loop, self.is_disconnected = engine, loop, is_disconnected
        self.queue: asyncio.Queue = asyncio.Queue()  # (prompt index, output or error), fed by the engine thread
        self.request_ids: list[str] = []  # the engine's request per prompt
        self._checked = time.monotonic()

    def close(self) -> None:
        for request_id in self.request_ids:  # the finished ones are released already: no-ops
            self.engine.release(request_id)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput, list[Delta]]]:
        return self._iterate()

    async def collect(self) -> list[RequestOutput]:
        """Every prompt's final output (non-streaming)."""
        last: list[RequestOutput | None] = [None] * len(self.request_ids)
        async for index, out, _ in self:
            last[index] = out
        if any(o is None or not o.finished for o in last):
            raise APIError(499, "the client disconnected")
        return last

    @staticmethod
    def deltas(out: RequestOutput) -> list[Delta]:
        """Per choice, what this output adds (the engine reports only that: the cost of a step's bookkeeping does
        not grow with what a choice already holds)."""
        return [Delta(c.delta_text, c.delta_token_ids, c.delta_logprobs or [], c.text_offset) for c in out.outputs]

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput, list[Delta]]]:
        left = len(self.request_ids)
        try:
            while left:
                item = await self._next()
                if item is None:  # client disconnected
                    return
                index, out = item
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    left -= 1
                    self.engine.streams.pop(self.request_ids[index], None)
                yield index, out, self.deltas(out)
        finally:
            self.close()

    async def _next(self):
        if self.is_disconnected is None:
            return await self.queue.get()
        while True:
            # outputs may arrive every few ms, so look for a departed client on a clock, not on idleness
            now = time.monotonic()
            if now - self._checked >= DISCONNECT_POLL_S:
                self._checked = now
                if await self.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue
