"""What a GLM model writes -> OpenAI's assistant message: reasoning, content, tool calls.

Behaves like vLLM's `glm45` reasoning and tool-call parsers:
- reasoning (thinking on; the prompt ends `<think>`): the text before `</think>` is
  `reasoning_content` (a leading `<think>` is dropped); without a `</think>` all of it is
  reasoning (a turn cut off while thinking). With thinking off there is no reasoning.
- tool calls (only when the request lists tools): each
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` becomes an OpenAI
  tool call; V is kept as a string where the tool's JSON schema types the argument as a string (or
  does not know it), else parsed as JSON (kept as the string when it is not JSON). Text outside calls
  is content. A call that is unclosed, malformed or names an unknown tool stays in `content` as
  written: never an error.

One incremental parser serves both shapes: `feed(text)` returns what became certain (text that might
still be the start of a marker is held back), `finish()` flushes the rest; the non-streaming body is
feed(all) + finish().
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str  # JSON object text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutputParser:
    def __init__(self, thinking: bool, tools: list[dict] | None):
        self.mode = "reasoning" if thinking else "content"
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.buf = ""
        self.space = ""  # whitespace seen right before a <tool_call>, kept if the call is malformed
        self.started = False  # whether the start of the reasoning has been looked at
        self.reasoning, self.content, self.calls = "", "", []

    # ---- incremental interface
    def feed(self, text: str) -> Delta:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> Delta:
        return self._drain(final=True)

    # ---- the state machine
    def _drain(self, final: bool) -> Delta:
        out = Delta()
        while True:
            if self.mode == "reasoning":
                if not self.started:  # a model may repeat the prompt's <think>: drop it
                    head = self.buf.lstrip()
                    if not final and len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                        return self._record(out)  # may still become <think>
                    self.buf = head[len(THINK_OPEN):] if head.startswith(THINK_OPEN) else self.buf
                    self.started = True
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    out.reasoning += self.buf[:i]
                    self.buf, self.mode = self.buf[i + len(THINK_CLOSE):], "content"
                    continue
                out.reasoning += self._safe(THINK_CLOSE, final)
                return self._record(out)
            if self.mode == "content":
                if not self.tools:
                    out.content += self._take_all()
                    return self._record(out)
                i = self.buf.find(CALL_OPEN)
                if i >= 0:  # whitespace right before a call is layout, not content (unless the call is bad)
                    body = self.buf[:i].rstrip()
                    out.content += body
                    self.space, self.buf, self.mode = self.buf[len(body):i], self.buf[i:], "call"
                    continue
                text = self._safe(CALL_OPEN, final)
                body = text.rstrip()
                if final:  # trailing whitespace after calls is layout too
                    out.content += body if (self.calls or out.calls) else text
                else:  # hold trailing whitespace until we know whether a call follows
                    out.content += body
                    self.buf = text[len(body):] + self.buf
                return self._record(out)
            # mode == "call": buf starts with <tool_call>
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                if final:  # never closed: the text stays content, as written
                    out.content += self.space + self._take_all()
                return self._record(out)
            raw = self.buf[: j + len(CALL_CLOSE)]
            self.buf, self.mode = self.buf[j + len(CALL_CLOSE):], "content"
            call = self._parse_call(raw[len(CALL_OPEN): -len(CALL_CLOSE)])
            if call is None:
                out.content += self.space + raw
            else:
                out.calls.append(call)
            self.space = ""

    def _safe(self, marker: str, final: bool) -> str:
        """Take the buffer except a tail that may be the start of `marker`."""
        keep = 0 if final else _partial_suffix(self.buf, marker)
        text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return text

    def _take_all(self) -> str:
        text, self.buf = self.buf, ""
        return text

    def _record(self, out: Delta) -> Delta:
        self.reasoning += out.reasoning
        self.content += out.content
        self.calls += out.calls
        return out

    def _parse_call(self, inner: str) -> ToolCallOut | None:
        k = inner.find("<arg_key>")
        name = (inner if k < 0 else inner[:k]).strip()
        if not name or name not in self.tools:
            return None
        rest = "" if k < 0 else inner[k:]
        if _PAIR.sub("", rest).strip():
            return None  # text that is not key/value pairs
        props = (self.tools[name].get("parameters") or {}).get("properties") or {}
        args = {key.strip(): _typed(value, props.get(key.strip())) for key, value in _PAIR.findall(rest)}
        return ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))

    # ---- the whole message
    def message(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message and finish reason ("tool_calls" when the turn ended in calls)."""
        msg = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [c.as_openai() for c in self.calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _typed(value: str, schema: dict | None):
    """An argument value as the tool's schema types it (strings stay strings)."""
    types = (schema or {}).get("type", "string")
    types = types if isinstance(types, list) else [types]
    if "string" in types or not schema:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
