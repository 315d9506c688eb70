"""The OpenAI endpoints' logic: request -> SamplingParams -> engine -> JSON body or SSE stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from openglm.engine.grammar import GrammarError
from openglm.engine.sampling_params import SamplingParams, SamplingParamsError
from openglm.server.async_engine import AsyncEngine
from openglm.server.errors import APIError
from openglm.server.protocol import ChatCompletionRequest, CompletionRequest
from openglm.server import render
from openglm.server.structured import json_layout, request_grammar
from openglm.tokenizer import TokenizerError


TOKENIZE_THREADS = 2  # rendering and tokenising run here, never on the event loop


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 grammar_engine=None, json_whitespace: str = "compact"):
        self.engine, self.tokenizer, self.grammar_engine = engine, tokenizer, grammar_engine
        self.json_whitespace = json_whitespace  # JSON layout of constrained output unless a request says
        self.model_name, self.max_model_len, self.vocab_size = model_name, max_model_len, vocab_size
        self.pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="openglm-tokenize")

    async def off_loop(self, fn, *args):
        """Run CPU-heavy request preparation (a template, a long prompt) in the tokenizer threads so
        that the event loop (other clients, /health) keeps answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # ---- request preparation ---------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.check_prompt(ids)

    def encode_all(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.encode(p) for p in prompts]

    def render_and_encode(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids; conversation text is never read as control tokens."""
        try:
            ids = self.tokenizer.apply_chat_template(
                req.template_messages(), tools=req.template_tools(), add_generation_prompt=req.add_generation_prompt,
                tokenize=True, enable_thinking=req.chat_template_kwargs.enable_thinking,
                clear_thinking=req.chat_template_kwargs.clear_thinking)
        except TokenizerError as exc:  # template errors (unknown role, bad structure) are the caller's
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return self.check_prompt(ids)

    def check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {len(ids)} tokens, leaving no room for output", param="prompt",
                           code="context_length_exceeded")
        return ids

    def params(self, req, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None, extra_stop_ids=()) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} is too large: the prompt has {prompt_len} tokens and "
                                f"this model's context is {self.max_model_len}", param="max_tokens",
                           code="context_length_exceeded")
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p), top_k=req.top_k, min_p=float(req.min_p),
                repetition_penalty=float(req.repetition_penalty), presence_penalty=float(req.presence_penalty),
                frequency_penalty=float(req.frequency_penalty), seed=req.seed,
                max_tokens=max_tokens or min(room, default_max or room), min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=set(req.stop_token_ids or ()) | set(extra_stop_ids),
                ignore_eos=req.ignore_eos, include_stop_str_in_output=req.include_stop_str_in_output,
                n=req.n, logprobs=logprobs)
        except SamplingParamsError as exc:
            raise APIError(400, str(exc), param=exc.field) from exc

    def _submit_all(self, prompts, params, is_disconnected) -> list:
        streams = []
        try:
            for ids, sp in zip(prompts, params):
                streams.append(self.engine.submit(ids, sp, is_disconnected))
        except APIError:
            for s in streams:  # all or nothing
                s.close()
            raise
        return streams

    # ---- endpoints ---------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        self.engine.check_fits(len(req.prompts()))
        prompts = await self.off_loop(self.encode_all, req.prompts())
        params = [self.params(req, len(ids), req.max_tokens, 16, req.logprobs) for ids in prompts]
        meta = render.Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, self.tokenizer)
        echo = [self.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        streams = self._submit_all(prompts, params, None if req.stream else request.is_disconnected)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(render.completion_stream(meta, _merge(streams), req.n, echo, include_usage))
        finals = await _collect(streams)
        return JSONResponse(render.completion_body(meta, finals, req.n, echo))

    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        thinking = req.chat_template_kwargs.enable_thinking
        ids = await self.off_loop(self.render_and_encode, req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self.params(req, len(ids), max_tokens, None, logprobs, self.tokenizer.stop_ids)
        params.grammar = self.grammar(req, thinking)
        meta = render.Meta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, self.tokenizer)
        tools = req.template_tools()
        stream = self.engine.submit(ids, params, None if req.stream else request.is_disconnected)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(render.chat_stream(meta, _merge([stream]), req.n, include_usage, thinking, tools))
        finals = await _collect([stream])
        return JSONResponse(render.chat_body(meta, finals[0], thinking, tools))

    def grammar(self, req: ChatCompletionRequest, thinking: bool) -> str | None:
        grammar = request_grammar(req, self.tokenizer, thinking, json_layout(req, self.json_whitespace))
        if grammar is not None:
            try:
                self.grammar_engine.check(grammar)
            except GrammarError as exc:
                param = "response_format" if req.response_format is not None else "tools"
                raise APIError(400, str(exc), param=param) from exc
        return grammar


async def _collect(streams) -> list:
    last = [None] * len(streams)
    async for i, out in _merge(streams):
        last[i] = out
    if any(o is None or not o.finished for o in last):
        raise APIError(499, "the client disconnected")
    return last


async def _merge(streams) -> AsyncIterator[tuple[int, object]]:
    """Interleave several request streams as (prompt index, output); cancelling stops them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                await q.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await q.put((i, exc))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as exc:  # too late for a status code: report in-band, as OpenAI does
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
