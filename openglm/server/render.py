"""Engine outputs -> OpenAI response bodies, and the request streams' (prompt index, output, deltas) ->
stream chunks (completions and chat)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from openglm.server.chat_output import ChatOutputParser


@dataclass
class Meta:
    id: str
    created: int
    model: str
    tokenizer: object

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_of(finals) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    gen = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return usage(prompt, gen, sum(o.num_cached_tokens for o in finals))


# ---- logprobs ---------------------------------------------------------------------------------------
def completion_logprobs(meta: Meta, entries: list[dict], offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        text = meta.token_text(e["token_id"])
        tokens.append(text)
        lps.append(e["logprob"])
        tops.append({meta.token_text(t): lp for t, lp in e["top"]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(meta: Meta, entries: list[dict]) -> dict:
    def item(token_id, lp):
        text = meta.token_text(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}


# ---- completions ------------------------------------------------------------------------------------
def completion_body(meta: Meta, finals, n: int, echo: list[str]) -> dict:
    choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            lp = completion_logprobs(meta, c.logprobs, len(echo[i])) if c.logprobs is not None else None
            choices.append({"index": i * n + c.index, "text": echo[i] + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    choices.sort(key=lambda ch: ch["index"])
    return {**meta.head("text_completion"), "choices": choices, "usage": _usage_of(finals)}


async def completion_stream(meta: Meta, outputs: AsyncIterator, n: int, echo: list[str],
                            include_usage: bool) -> AsyncIterator[dict]:
    finals, sent_echo, done = {}, set(), set()
    extra = {"usage": None} if include_usage else {}
    async for i, out, deltas in outputs:
        for c, d in zip(out.outputs, deltas):
            idx = i * n + c.index
            text = d.text
            if echo[i] and idx not in sent_echo:
                text = echo[i] + text
                sent_echo.add(idx)
            if idx in done or (not text and not d.token_ids and not c.finished):
                continue
            if c.finished:
                done.add(idx)
            lp = None
            if c.logprobs is not None:
                lp = completion_logprobs(meta, d.logprobs, d.offset)
            yield {**meta.head("text_completion"), **extra,
                   "choices": [{"index": idx, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason if c.finished else None}]}
        if out.finished:
            finals[i] = out
    if include_usage:
        yield {**meta.head("text_completion"), "choices": [], "usage": _usage_of(list(finals.values()))}


# ---- chat -------------------------------------------------------------------------------------------
def chat_body(meta: Meta, final, thinking: bool | str, tools: list[dict] | None) -> dict:
    choices = []
    for c in final.outputs:
        parser = ChatOutputParser(thinking, tools)
        parser.feed(c.text)
        parser.finish()
        message, finish_reason = parser.message(c.finish_reason)
        if "reasoning_content" in message:  # vLLM's field name and the older one (clients read either)
            message["reasoning"] = message["reasoning_content"]
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(meta, c.logprobs) if c.logprobs is not None else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {**meta.head("chat.completion"), "choices": choices, "usage": _usage_of([final])}


def _delta_body(delta) -> dict:
    body = {}
    if delta.reasoning:  # vLLM's field name and the older one (clients read either)
        body["reasoning"] = body["reasoning_content"] = delta.reasoning
    if delta.content:
        body["content"] = delta.content
    if delta.calls:
        body["tool_calls"] = tool_call_deltas(delta.calls)
    return body


def tool_call_deltas(pieces) -> list[dict]:
    """OpenAI's `delta.tool_calls`: one entry per call, the first piece of a call with its id and name."""
    out: dict[int, dict] = {}
    for p in pieces:
        entry = out.get(p.index)
        if entry is None:
            entry = out[p.index] = {"index": p.index, "function": {"arguments": ""}}
            if p.id is not None:
                entry.update(id=p.id, type="function", function={"name": p.name, "arguments": ""})
        entry["function"]["arguments"] += p.arguments
    return list(out.values())


async def chat_stream(meta: Meta, outputs: AsyncIterator, n: int, include_usage: bool, thinking: bool | str,
                      tools: list[dict] | None) -> AsyncIterator[dict]:
    extra = {"usage": None} if include_usage else {}
    for idx in range(n):  # the role comes first, as OpenAI sends it
        yield {**meta.head("chat.completion.chunk"), **extra,
               "choices": [{"index": idx, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]}
    final, done = None, set()
    parsers = [ChatOutputParser(thinking, tools) for _ in range(n)]
    async for _, out, deltas in outputs:
        for c, d in zip(out.outputs, deltas):
            if c.index in done or (not d.text and not c.finished and not d.logprobs):
                continue
            parser = parsers[c.index]
            delta = parser.feed(d.text)
            finish_reason = None
            if c.finished:
                done.add(c.index)
                delta.extend(parser.finish())
                finish_reason = parser.message(c.finish_reason)[1]
            lp = chat_logprobs(meta, d.logprobs) if c.logprobs is not None else None
            body = _delta_body(delta)
            if not body and lp is None and finish_reason is None:
                continue  # held back (a possible marker): nothing certain to send yet
            yield {**meta.head("chat.completion.chunk"), **extra,
                   "choices": [{"index": c.index, "delta": body, "logprobs": lp, "finish_reason": finish_reason}]}
        if out.finished:
            final = out
    if include_usage and final is not None:
        yield {**meta.head("chat.completion.chunk"), "choices": [], "usage": _usage_of([final])}
