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
from openglm.engine.llm_engine import PromptError
from openglm.engine.sampling_params import SamplingParams, SamplingParamsError
from openglm.server.async_engine import AsyncEngine
from openglm.server.errors import APIError
from openglm.server.protocol import ChatCompletionRequest, CompletionRequest
from openglm.server import render
from openglm.server.structured import json_layout, request_grammar
from openglm.tokenizer import TokenizerError


TOKENIZE_THREADS = 2  # rendering and tokenising run here, never on the event loop


class OpenAIServing:
    """The endpoints over an `AsyncEngine`. Of the engine itself they use only what never changes while it runs:
    its tokenizer, `check_prompt`, `max_model_len` and the grammar compiler (built here, once)."""

    def __init__(self, engine: AsyncEngine, model_name: str, json_whitespace: str = "compact"):
        self.engine, self.model_name = engine, model_name
        self.llm = engine.engine
        self.tokenizer, self.max_model_len = self.llm.tokenizer, self.llm.max_model_len
        self.grammar_engine = self.llm.grammar
        self.json_whitespace = json_whitespace  # JSON layout of constrained output unless a request says
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
    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids after the engine's own check, made before anything is queued or streamed (so a
        bad prompt is a 400, never an error in the middle of a stream)."""
        try:
            return self.llm.check_prompt(prompt)
        except PromptError as exc:
            raise APIError(400, str(exc), param="prompt", code=exc.code) from exc

    def check_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.check_prompt(p) for p in prompts]

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

    # ---- endpoints ---------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        self.engine.check_fits(len(req.prompts()))
        prompts = await self.off_loop(self.check_prompts, req.prompts())
        params = [self.params(req, len(ids), req.max_tokens, 16, req.logprobs) for ids in prompts]
        meta = render.Meta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, self.tokenizer)
        echo = [self.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        stream = self.engine.submit(prompts, params, None if req.stream else request.is_disconnected)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(render.completion_stream(meta, stream, req.n, echo, include_usage))
        finals = await stream.collect()
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
        stream = self.engine.submit([ids], [params], None if req.stream else request.is_disconnected)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(render.chat_stream(meta, stream, req.n, include_usage, thinking, tools))
        finals = await stream.collect()
        return JSONResponse(render.chat_body(meta, finals[0], thinking, tools))

    def grammar(self, req: ChatCompletionRequest, thinking: bool) -> str | None:
        """The grammar the answer decodes under, checked here (a 400); None when nothing constrains it. A request
        with tools enters structured.py even when no call is forced: their schemas are checked (a 400 naming the
        keyword) because the output parser types arguments by them."""
        if not (req.tools or req.constrained()):
            return None
        grammar = request_grammar(req, self.tokenizer, thinking, json_layout(req, self.json_whitespace))
        if grammar is None:
            return None
        try:
            self.grammar_engine.check(grammar)
        except GrammarError as exc:
            param = "response_format" if req.response_format is not None else "tools"
            raise APIError(400, str(exc), param=param) from exc
        return grammar


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
