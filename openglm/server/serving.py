"""The OpenAI endpoints' logic: request -> SamplingParams -> engine -> JSON body or SSE stream.

A request is prepared off the event loop and off the engine thread: chat templates are rendered, string prompts
tokenised and new output grammars compiled in the prepare workers (`server/prepare.py`: processes, with budgets);
the rest (schema checks, token-id checks) in a small thread pool, and a grammar that passed its budget is compiled
for the engine in a low-priority thread."""

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
from openglm.server import render, responses, thinking, tokens
from openglm.server.async_engine import AsyncEngine
from openglm.server.errors import APIError
from openglm.server.limits import ServerLimits
from openglm.server.prepare import PrepareError, PrepareWorkers
from openglm.server.protocol import ChatCompletionRequest, ChatTemplateKwargs, CompletionRequest
from openglm.server.structured import json_layout, request_grammar

TOKENIZE_THREADS = 2  # request checks too slow for the event loop run here (schemas, token ids)


class OpenAIServing:
    """The endpoints over an `AsyncEngine`. Of the engine itself they use only what never changes while it runs:
    its tokenizer, `check_prompt`, `max_model_len` and the grammar compiler (built here, once)."""

    def __init__(self, engine: AsyncEngine, model_name: str, json_whitespace: str = "compact",
                 default_chat_template_kwargs: dict | None = None, thinking_token_budget: int | None = None,
                 limits: ServerLimits | None = None):
        self.engine, self.model_name = engine, model_name
        self.llm = engine.engine
        self.tokenizer, self.max_model_len = self.llm.tokenizer, self.llm.max_model_len
        self.grammar_engine = self.llm.grammar
        self.json_whitespace = json_whitespace  # JSON layout of constrained output unless a request says
        # what a request leaves unset: the template switches (vLLM's --default-chat-template-kwargs), the budget
        self.template_defaults = ChatTemplateKwargs.model_validate(default_chat_template_kwargs or {})
        if thinking_token_budget is not None and thinking_token_budget < 0:
            raise ValueError(f"thinking_token_budget must be a non-negative integer, got {thinking_token_budget}")
        self.thinking_budget = thinking_token_budget
        self.think_ids = tuple(self.tokenizer.marker_id(m) for m in ("<think>", "</think>"))
        self.pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="openglm-tokenize")
        # started and stopped with the app (create_app's lifespan)
        self.prepare = PrepareWorkers(self.tokenizer, self.llm.vocab_size, self.max_model_len, limits or ServerLimits())

    async def off_loop(self, fn, *args):
        """Run request checks too slow for the event loop (a large schema, a long list of token ids) in a thread, so
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

    async def prompt_ids(self, prompts: list[str | list[int]], is_disconnected=None) -> list[list[int]]:
        """Each prompt's token ids, checked: a string is tokenised in a prepare worker (refused there, before it is
        tokenised whole, when it cannot fit)."""
        try:
            ids = [p if not isinstance(p, str) else await self.prepare.text(p, is_disconnected) for p in prompts]
        except PrepareError as exc:
            raise APIError(499 if exc.cancelled else 400, str(exc), param="prompt", code=exc.code) from exc
        return await self.off_loop(lambda: [self.check_prompt(p) for p in ids])

    async def render(self, req: ChatCompletionRequest, choice: thinking.ThinkingChoice,
                     is_disconnected=None) -> list[int]:
        """The chat prompt's token ids, rendered and tokenised in a prepare worker within the template's budget;
        conversation text is never read as control tokens."""
        kwargs = {"enable_thinking": choice.enabled, "clear_thinking": choice.clear}
        try:
            return await self.prepare.chat(req.template_messages(), req.template_tools(), req.add_generation_prompt,
                                           kwargs, is_disconnected)
        except PrepareError as exc:  # template errors and limits (unknown role, a loop over its time) are 400s
            raise APIError(499 if exc.cancelled else 400, f"cannot apply the chat template: {exc}", param="messages",
                           code=exc.code) from exc

    async def render_and_encode(self, req: ChatCompletionRequest, choice: thinking.ThinkingChoice,
                                is_disconnected=None) -> list[int]:
        return await self.off_loop(self.check_prompt, await self.render(req, choice, is_disconnected))

    def reasoning_mode(self, ids: list[int]) -> str:
        """How the answer to this prompt starts (chat_output.py's modes): "open" when the prompt ends `<think>`
        (GLM-4.7/5, thinking on), "off" when it ends `</think>` (thinking off), else "optional" (GLM-4.5/4.6
        templates leave the `<think>` to the model)."""
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False).rstrip()
        if ids[-1] == self.think_ids[0] or tail.endswith("<think>"):
            return "open"
        if ids[-1] == self.think_ids[1] or tail.endswith("</think>"):
            return "off"
        return "optional"

    def budget(self, params: SamplingParams, req: ChatCompletionRequest, choice: thinking.ThinkingChoice,
               mode: str) -> None:
        """Set the thinking budget on `params` (engine/thinking.py) where the answer may reason."""
        budget = choice.budget_for(req.constrained(), params.max_tokens)
        if budget is None or mode == "off":
            return
        if None in self.think_ids:
            if req.thinking_token_budget is None:
                return  # only a default: without one-token markers the budget cannot be forced
            raise APIError(400, "this tokenizer has no single-token <think> / </think>, so a thinking budget cannot "
                                "be enforced", param="thinking_token_budget")
        params.thinking_budget, params.think_ids, params.thinking_open = budget, self.think_ids, mode == "open"
        call = self.tokenizer.marker_id("<tool_call>")
        if req.template_tools() and call is not None:  # a call before </think> ends the reasoning (chat_output.py)
            params.think_end_ids = (call,)

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
        prompts = await self.prompt_ids(req.prompts(), request.is_disconnected)
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
        mode, params, stream = await self.start_chat(req, request)
        meta = render.Meta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, self.tokenizer)
        tools = req.template_tools()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(render.chat_stream(meta, stream, req.n, include_usage, mode, tools))
        finals = await stream.collect()
        return JSONResponse(render.chat_body(meta, finals[0], mode, tools))

    async def start_chat(self, req: ChatCompletionRequest, request: Request):
        """Check, render and queue a chat request: (its reasoning mode, its SamplingParams, its output stream)."""
        self.check_model(req.model)
        choice = thinking.resolve(req, self.template_defaults, self.thinking_budget)
        ids = await self.render_and_encode(req, choice, request.is_disconnected)
        mode = self.reasoning_mode(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self.params(req, len(ids), max_tokens, None, logprobs, self.tokenizer.stop_ids)
        params.grammar = await self.grammar(req, mode, request.is_disconnected)
        self.budget(params, req, choice, mode)
        stream = self.engine.submit([ids], [params], None if req.stream else request.is_disconnected)
        return mode, params, stream

    async def responses(self, body, request: Request):
        """`POST /v1/responses` (server/responses.py): the chat path, answered as Responses output items."""
        req = responses.chat_request(body)
        if req.n != 1:
            raise APIError(400, "n: a response holds one answer", param="n")
        mode, _, stream = await self.start_chat(req, request)
        head = responses.response_head(body, req, self.model_name)
        tools = req.template_tools()
        count = lambda ids: self.reasoning_tokens(mode, ids, bool(tools))  # noqa: E731
        if req.stream:
            return _sse(responses.events(head, stream, mode, tools, count), named=True)
        finals = await stream.collect()
        return JSONResponse(responses.body(head, finals[0], mode, tools, count))

    def reasoning_tokens(self, mode: str, ids: list[int], tools: bool = False) -> int:
        """Output tokens spent reasoning: those before the first `</think>`, or before a `<tool_call>` where tools
        are listed (a call ends the reasoning); all of them if neither came."""
        opened = mode == "open" or (mode == "optional" and self.think_ids[0] in ids[:2])
        if not opened:
            return 0
        ends = {self.think_ids[1]} | ({self.tokenizer.marker_id("<tool_call>")} if tools else set())
        return next((k for k, t in enumerate(ids) if t in ends), len(ids))

    async def tokenize(self, body) -> dict:
        """`/tokenize` (server/tokens.py): a prompt's ids, or those of the prompt a chat request renders."""
        options, chat = tokens.tokenize_request(body)
        self.check_model(options.model)
        if chat is not None:
            choice = thinking.resolve(chat, self.template_defaults, self.thinking_budget)
            ids = await self.render(chat, choice)
        else:  # in a prepare worker: a prompt that cannot fit is refused before it is tokenised whole
            try:
                ids = await self.prepare.text(options.prompt)
            except PrepareError as exc:
                raise APIError(400, str(exc), param="prompt", code=exc.code) from exc
            ids = self.tokenizer.bos_ids + ids if options.add_special_tokens else ids
        return tokens.tokenize_body(ids, self.max_model_len, self.tokenizer.decode, options.return_token_strs)

    async def detokenize(self, body) -> dict:
        req = tokens.parsed(tokens.Detokenize, body)
        self.check_model(req.model)
        if req.tokens and max(req.tokens) >= self.llm.vocab_size:
            raise APIError(400, f"tokens: ids must be in [0, {self.llm.vocab_size})", param="tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, req.tokens)}

    async def grammar(self, req: ChatCompletionRequest, thinking: str, is_disconnected=None) -> str | None:
        """The grammar the answer decodes under, checked and compiled here (a 400 in one line when it cannot be, or
        not within the budget); None when nothing constrains it. A request with tools enters structured.py even
        when no call is forced: their schemas are checked (a 400 naming the keyword) because the output parser
        types arguments by them. The compiled grammar is cached: the request's `n` sequences share it."""
        if not (req.tools or req.constrained()):
            return None
        grammar = await self.off_loop(request_grammar, req, self.tokenizer, thinking,
                                      json_layout(req, self.json_whitespace))
        if grammar is None:
            return None
        try:
            await self.prepare.grammar(grammar, is_disconnected)  # a new grammar: compiled within its budget first
            await self.prepare.at_low_priority(self.grammar_engine.compile, grammar)
        except (PrepareError, GrammarError) as exc:
            param = "response_format" if req.response_format is not None else "tools"
            cancelled = isinstance(exc, PrepareError) and exc.cancelled
            raise APIError(499 if cancelled else 400, str(exc), param=param) from exc
        return grammar


def _sse(chunks: AsyncIterator[dict], named: bool = False) -> StreamingResponse:
    """Server-sent events: chat and completion chunks end with `[DONE]`; Responses events (`named`) carry their
    type as the SSE event name and end with the response itself."""
    async def body():
        try:
            async for chunk in chunks:
                head = f"event: {chunk['type']}\n" if named else ""
                yield f"{head}data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as exc:  # too late for a status code: report in-band, as OpenAI does
            head = "event: error\n" if named else ""
            yield f"{head}data: {json.dumps({'type': 'error', **exc.body()} if named else exc.body())}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
