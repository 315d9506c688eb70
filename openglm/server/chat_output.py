"""What a GLM model writes -> OpenAI's assistant message: reasoning, content, tool calls.

Behaves like vLLM's `glm45` / `glm47` reasoning and tool-call parsers (tests/server/peer_cases holds
their cases as data; docs/serving.md lists where openglm deliberately differs):
- reasoning: with `thinking="open"` (True; the prompt ends `<think>`, as GLM-4.7/5 templates write it)
  the text before `</think>` is `reasoning_content` (a leading `<think>` is dropped) and without a
  `</think>` all of it is reasoning (a turn cut off while thinking); with `"optional"` (a template whose
  prompt leaves the opening to the model, as GLM-4.5/4.6's) reasoning starts only where the output
  starts with `<think>`; with "off" (False) there is none.
- tool calls (only when the request lists tools): each
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` of a listed tool becomes
  an OpenAI tool call, V typed by the tool's JSON schema (`server/json_schema.py`: a plain string stays
  the text, anything else is decoded as JSON). Text outside calls is content. A call that is unclosed,
  malformed or names an unknown tool stays text, as written: never an error. A well-formed call written
  before `</think>` ends the reasoning (a model may skip `</think>` and go straight to its call); a
  `</think>` that then follows the calls is dropped.

One incremental parser serves both shapes: `feed(text)` returns what became certain (text that might
still be the start of a marker, and whitespace that might precede a call, is held back), `finish()`
flushes the rest; the non-streaming body is feed(all) + finish().
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from openglm.server.json_schema import Schema, SchemaError

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
REASONING_MODES = {True: "open", False: "off", "open": "open", "optional": "optional", "off": "off"}


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


class _Tool:
    """A listed tool: its argument schemas, read once."""

    def __init__(self, fn: dict):
        try:
            self.schema = Schema(fn.get("parameters") or {}, "parameters")
            props, _, self.extra = self.schema.object_view()
        except SchemaError:  # refused at the request already; typed as "any JSON" if it ever gets here
            self.schema, props, self.extra = Schema({}, "parameters"), [], None
        self.props = dict(props)

    def value(self, key: str, text: str):
        pointer = self.props.get(key, self.extra)
        return self.schema.value(text, None if pointer is None else self.schema.node(pointer))


class ChatOutputParser:
    def __init__(self, thinking: bool | str, tools: list[dict] | None):
        if thinking not in REASONING_MODES:
            raise ValueError(f"thinking must be one of {sorted(map(str, REASONING_MODES))}, got {thinking!r}")
        self.mode = {"open": "reasoning", "optional": "maybe", "off": "content"}[REASONING_MODES[thinking]]
        self.tools = {t["function"]["name"]: _Tool(t["function"]) for t in tools or []}
        self.buf = ""
        self.space = ""  # whitespace seen right before a <tool_call>, kept if the call is malformed
        self.started = False  # whether the start of the reasoning has been looked at
        self.late_close = False  # a call ended the reasoning: a </think> after the calls is dropped
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
            step = getattr(self, f"_{self.mode}")(out, final)
            if not step:
                self.reasoning += out.reasoning
                self.content += out.content
                self.calls += out.calls
                return out

    def _maybe(self, out: Delta, final: bool) -> bool:
        """Reasoning only if the output opens it (GLM-4.5/4.6 templates leave the <think> to the model)."""
        head = self.buf.lstrip()
        if not final and THINK_OPEN.startswith(head):
            return False  # may still become <think>
        self.mode = "reasoning" if head.startswith(THINK_OPEN) else "content"
        return True

    def _reasoning(self, out: Delta, final: bool) -> bool:
        if not self.started:  # a model may repeat the prompt's <think>: drop it
            head = self.buf.lstrip()
            if not final and len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return False
            self.buf = head[len(THINK_OPEN):] if head.startswith(THINK_OPEN) else self.buf
            self.started = True
        i = self.buf.find(THINK_CLOSE)
        k = self.buf.find(CALL_OPEN) if self.tools else -1
        if i >= 0 and (k < 0 or i < k):
            out.reasoning += self.buf[:i]
            self.buf, self.mode = self.buf[i + len(THINK_CLOSE):], "content"
            return True
        if k >= 0:  # a call before </think>: it ends the reasoning if it is well-formed
            body = self.buf[:k].rstrip()
            out.reasoning += body
            self.space, self.buf, self.mode = self.buf[len(body):k], self.buf[k:], "reasoning_call"
            return True
        markers = (THINK_CLOSE, CALL_OPEN) if self.tools else (THINK_CLOSE,)
        text = self._safe(markers, final)
        if self.tools and not final:  # hold trailing whitespace until we know whether a call follows
            body = text.rstrip()
            self.buf = text[len(body):] + self.buf
            text = body
        out.reasoning += text
        return False

    def _reasoning_call(self, out: Delta, final: bool) -> bool:
        j = self.buf.find(CALL_CLOSE)
        if j < 0:
            if final:  # never closed: the text stays reasoning, as written
                out.reasoning += self.space + self._take_all()
            return False
        raw = self.buf[: j + len(CALL_CLOSE)]
        self.buf = self.buf[j + len(CALL_CLOSE):]
        call = self._parse_call(raw[len(CALL_OPEN): -len(CALL_CLOSE)])
        if call is None:
            out.reasoning += self.space + raw
            self.mode = "reasoning"
        else:
            out.calls.append(call)
            self.mode, self.late_close = "content", True
        self.space = ""
        return True

    def _content(self, out: Delta, final: bool) -> bool:
        if not self.tools:
            out.content += self._take_all()
            return False
        if self.late_close:  # the reasoning ended at a call: drop a </think> written after the calls
            head = self.buf.lstrip()
            if not final and THINK_CLOSE.startswith(head):
                return False
            if head.startswith(THINK_CLOSE):
                self.buf, self.late_close = head[len(THINK_CLOSE):], False
                return True
            if not head.startswith(CALL_OPEN[: len(head)]):
                self.late_close = False
        i = self.buf.find(CALL_OPEN)
        if i >= 0:  # whitespace right before a call is layout, not content (unless the call is bad)
            body = self.buf[:i].rstrip()
            out.content += body
            self.space, self.buf, self.mode = self.buf[len(body):i], self.buf[i:], "call"
            return True
        text = self._safe((CALL_OPEN,), final)
        body = text.rstrip()
        if final:  # trailing whitespace after calls is layout too
            out.content += body if (self.calls or out.calls) else text
        else:  # hold trailing whitespace until we know whether a call follows
            out.content += body
            self.buf = text[len(body):] + self.buf
        return False

    def _call(self, out: Delta, final: bool) -> bool:  # buf starts with <tool_call>
        j = self.buf.find(CALL_CLOSE)
        if j < 0:
            if final:  # never closed: the text stays content, as written
                out.content += self.space + self._take_all()
            return False
        raw = self.buf[: j + len(CALL_CLOSE)]
        self.buf, self.mode = self.buf[j + len(CALL_CLOSE):], "content"
        call = self._parse_call(raw[len(CALL_OPEN): -len(CALL_CLOSE)])
        if call is None:
            out.content += self.space + raw
        else:
            out.calls.append(call)
        self.space = ""
        return True

    def _safe(self, markers: tuple[str, ...], final: bool) -> str:
        """Take the buffer except a tail that may be the start of one of `markers`."""
        keep = 0 if final else max(_partial_suffix(self.buf, m) for m in markers)
        text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return text

    def _take_all(self) -> str:
        text, self.buf = self.buf, ""
        return text

    def _parse_call(self, inner: str) -> ToolCallOut | None:
        k = inner.find("<arg_key>")
        name = (inner if k < 0 else inner[:k]).strip()
        if not name or name not in self.tools:
            return None
        rest = "" if k < 0 else inner[k:]
        if _PAIR.sub("", rest).strip():
            return None  # text that is not key/value pairs
        tool = self.tools[name]
        args = {key.strip(): tool.value(key.strip(), value) for key, value in _PAIR.findall(rest)}
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
