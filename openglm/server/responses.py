"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: the request becomes a chat request (one
engine, one template, one output parser), the parsed answer becomes Responses output items.

- In: `input` (a string, or items: messages with text parts, `function_call`, `function_call_output` and
  `reasoning` items, as a client replays a previous response), `instructions` (a leading system message),
  function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format` (json_object / json_schema),
  `reasoning.effort`, `max_output_tokens`, `temperature`, `top_p`, `stream`; openglm's chat extras pass
  through unchanged (`seed`, `top_k`, `thinking`, `chat_template_kwargs`, `thinking_token_budget`, ...).
  Nothing is stored: what needs a stored response (`previous_response_id`, `conversation`, a stored
  `prompt`, `background`, `item_reference` items) is a 400 naming the field, as are non-function tools,
  image/file parts and `truncation: "auto"`.
- Out: a `reasoning` item (its text as `reasoning_text` content; no summary), a `message` item with the
  answer as `output_text`, a `function_call` item per call (`call_id` is the chat call id); `status`
  `incomplete` with `incomplete_details.reason` `max_output_tokens` when the turn was cut off. Streamed as
  the Responses events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
  `response.reasoning_text.delta`, `response.function_call_arguments.delta`, the `.done` events,
  `response.completed` / `response.incomplete`), each an SSE `event:` + `data:` with a `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from pydantic import ValidationError

from openglm.server.chat_output import ChatOutputParser, Delta
from openglm.server.errors import APIError, validation_message
from openglm.server.protocol import MEDIA_PARTS, ChatCompletionRequest, media_refusal

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
STORED_ONLY = ("previous_response_id", "conversation", "prompt")  # they name stored objects: this server keeps none
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


# ---- the request -> a chat request -------------------------------------------------------------------
def chat_request(body) -> ChatCompletionRequest:
    """The chat request a Responses request asks for; a 400 naming the Responses field when it is unusable."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param="body")
    for name in STORED_ONLY:
        if body.get(name) not in (None, "", {}):
            raise APIError(400, f"{name}: responses are not stored on this server: send the whole conversation as "
                                "`input`", param=name)
    if body.get("background"):
        raise APIError(400, "background: responses run in the foreground here (nothing is stored)", param="background")
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, "truncation: only 'disabled' (a conversation longer than the context is a 400)",
                       param="truncation")
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs: not supported on /v1/responses (use /v1/chat/completions' logprobs)",
                       param="top_logprobs")
    messages, sources = _messages(body.get("input"), body.get("instructions"))
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions", "tools", "tool_choice", "text",
                                                       "reasoning", "max_output_tokens", "include", "truncation",
                                                       "background", *STORED_ONLY)}
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise APIError(400, f"max_output_tokens must be at least 1, got {limit!r}"[:200], param="max_output_tokens")
        chat["max_completion_tokens"] = limit
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        named = _responses_param(param, sources)
        raise APIError(400, message.replace(param, named, 1), param=named) from None


def _messages(items, instructions) -> tuple[list[dict], list[str]]:
    """Chat messages for `input`, and where each came from (for error messages). A response's items replayed
    (reasoning, message, function calls) become one assistant turn; a tool output or a user message ends it."""
    out, sources = [], []

    def add(message: dict, where: str) -> None:
        out.append(message)
        sources.append(where)

    if instructions:
        add({"role": "system", "content": instructions}, "instructions")
    if isinstance(items, str):
        add({"role": "user", "content": items}, "input")
        return out, sources
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a string or a non-empty list of items", param="input")
    turn, reasoning = None, None  # the assistant message function calls join; reasoning waiting for its turn
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "\n".join(x for x in (reasoning, _text(parts, f"{where}.content")) if x)
            continue
        if kind == "message" and item.get("role") == "assistant" or kind == "function_call":
            if kind == "message" or turn is None:
                add({"role": "assistant", "content": _text(item.get("content"), f"{where}.content") or ""}, where)
                turn = out[-1]
            if reasoning:
                turn["reasoning_content"] = "\n".join(x for x in (turn.get("reasoning_content"), reasoning) if x)
                reasoning = None
            if kind == "function_call":
                turn.setdefault("tool_calls", []).append({
                    "id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}})
            continue
        turn = None
        if kind == "message":
            add({"role": item.get("role"), "content": _text(item.get("content"), f"{where}.content")}, where)
        elif kind == "function_call_output":
            output = item.get("output")
            add({"role": "tool", "tool_call_id": item.get("call_id"),
                 "content": output if isinstance(output, str) else _text(output, f"{where}.output")}, where)
        else:
            why = "needs a stored item" if kind == "item_reference" else \
                "is not supported (messages, function calls, their outputs and reasoning only)"
            raise APIError(400, f"{where}.type: an input item of type {kind!r} {why}", param=f"{where}.type")
    return out, sources


def _text(content, where: str):
    """A content field as chat content: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise APIError(400, f"{where}.{j}: {media_refusal(kind)}", param=f"{where}.{j}")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.{j}: a content part must be a text part ({', '.join(TEXT_PARTS[:3])})",
                           param=f"{where}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools.{i}.type: only function tools are supported, got {kind!r}",
                           param=f"tools.{i}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, str):
        return choice
    raise APIError(400, f"tool_choice: 'none', 'auto', 'required' or a function ({{\"type\": \"function\", "
                        f"\"name\": ...}}), got {choice!r}"[:300], param="tool_choice")


def _response_format(fmt):
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _responses_param(param: str, sources: list[str]) -> str:
    """A chat request's field path as the Responses request's."""
    head, _, rest = param.partition(".")
    if head == "messages":
        k, _, tail = rest.partition(".")
        if k.isdigit() and int(k) < len(sources):
            return sources[int(k)] + (f".{tail}" if tail else "")
        return "input"
    if head == "tools":
        return param.replace(".function.", ".", 1)
    if head == "response_format":  # text.format holds json_schema's fields itself
        rest = rest[len("json_schema."):] if rest.startswith("json_schema.") else rest
    return RENAMED.get(head, head) + (f".{rest}" if rest else "")


# ---- the answer -> Responses output items and stream events ------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Chat-output deltas -> Responses output items (`items`), and the stream events that build them; the
    items are the same whether they were streamed or not."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # the parser's call index -> its function_call item
        self.sequence = 0

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, delta: Delta) -> list[dict]:
        # a delta's pieces of the call that was open before it come first in the text; new text, then new calls
        pieces = list(delta.calls)
        lead = 0
        while lead < len(pieces) and pieces[lead].id is None:
            lead += 1
        events = self._calls(pieces[:lead])
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        return events + self._calls(pieces[lead:])

    def _calls(self, pieces) -> list[dict]:
        events = []
        for piece in pieces:
            if piece.id is not None:
                events += self.close()
                events += self._add({"type": "function_call", "id": _id("fc"), "call_id": piece.id,
                                     "name": piece.name, "arguments": "", "status": "in_progress"})
                self.calls[piece.index] = self.open
            item = self.calls[piece.index]
            item["arguments"] += piece.arguments
            if piece.arguments:
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=self.items.index(item), delta=piece.arguments))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "content": [],
                        "status": "in_progress"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(item)
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=_copy(part)))
        item = self.open
        item["content"][0]["text"] += text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(kind_event, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                 delta=text, **extra))
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open item (its `.done` events)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, events = len(self.items) - 1, []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events += [self.event(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                  **extra),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=_copy(part))]
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events


def _copy(value: dict) -> dict:
    return json.loads(json.dumps(value))


def response_head(body: dict, req: ChatCompletionRequest, model: str) -> dict:
    """The response object's fields that echo the request (the SDKs read them), status in progress."""
    return {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None}, "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or ("auto" if req.tools else "none"),
            "tools": body.get("tools") or [], "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled", "usage": None, "user": body.get("user")}


def finished(head: dict, writer: ResponseWriter, finish_reason: str | None, usage: dict) -> dict:
    """The whole response once the turn is over (`incomplete` when `max_output_tokens` cut it off)."""
    cut = finish_reason == "length"
    return {**head, "status": "incomplete" if cut else "completed", "output": writer.items, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


def usage(final, reasoning_tokens: int) -> dict:
    prompt, out = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + out}


def body(head: dict, final, mode: str, tools, reasoning_tokens) -> dict:
    """The non-streaming response."""
    c = final.outputs[0]
    parser, writer = ChatOutputParser(mode, tools), ResponseWriter()
    writer.feed(parser.feed(c.text).extend(parser.finish()))
    writer.close("incomplete" if c.finish_reason == "length" else "completed")
    return finished(head, writer, c.finish_reason, usage(final, reasoning_tokens(c.token_ids)))


async def events(head: dict, outputs: AsyncIterator, mode: str, tools, reasoning_tokens) -> AsyncIterator[dict]:
    """The stream: the events that build the response, then the response whole."""
    parser, writer = ChatOutputParser(mode, tools), ResponseWriter()
    yield writer.event("response.created", response=head)
    yield writer.event("response.in_progress", response=head)
    final = None
    async for _, out, deltas in outputs:
        c = out.outputs[0]
        delta = parser.feed(deltas[0].text)
        if c.finished:
            delta.extend(parser.finish())
        for event in writer.feed(delta):
            yield event
        if out.finished:
            final = out
    if final is None:
        return
    c = final.outputs[0]
    for event in writer.close("incomplete" if c.finish_reason == "length" else "completed"):
        yield event
    whole = finished(head, writer, c.finish_reason, usage(final, reasoning_tokens(c.token_ids)))
    yield writer.event(f"response.{whole['status']}", response=whole)
