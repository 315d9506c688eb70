"""What a GLM model writes -> OpenAI's assistant message: reasoning, content, tool calls.

Behaves like vLLM's `glm45` / `glm47` reasoning and tool-call parsers (tests/server/peer_glm_cases.py holds
their cases as data; docs/serving.md lists where openglm deliberately differs):
- reasoning: with `thinking="open"` (True; the prompt ends `<think>`, as GLM-4.7/5 templates write it)
  the text before `</think>` is `reasoning_content` (a leading `<think>` is dropped) and without a
  `</think>` all of it is reasoning (a turn cut off while thinking); with `"optional"` (a template whose
  prompt leaves the opening to the model, as GLM-4.5/4.6's) reasoning starts only where the output
  starts with `<think>`; with "off" (False) there is none.
- tool calls (only when the request lists tools): each
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` of a listed tool becomes
  an OpenAI tool call, V typed by the tool's JSON schema (`server/json_schema.py`: a plain string stays
  the text, anything else is decoded as JSON). Text outside calls is content. A call written before
  `</think>` ends the reasoning (a model may skip `</think>` and go straight to its call); a `</think>` that
  then follows the calls is dropped.
- streaming: a call is a call from the moment its name is complete and names a listed tool (the
  `<arg_key>` or `</tool_call>` after it), and its arguments are streamed from then on as OpenAI-style
  fragments of one JSON object text: `{`, each `"key": ` with its value (a plain-string value as it
  is generated, any other value when its `</arg_value>` arrives), `}` at `</tool_call>`. What a stream
  sent is never taken back, so a call ends where its body stops being key/value pairs (the text from
  there on is text again) or where the turn ends (it keeps the arguments that arrived). A `<tool_call>`
  whose name is not a listed tool stays text, as written.

One incremental parser serves both shapes: `feed(text)` returns what became certain (text that might
still be the start of a marker, and whitespace that might precede a call, is held back), `finish()`
flushes the rest; the non-streaming body is feed(all) + finish(), so both give the same message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from openglm.server.json_schema import Schema, SchemaError

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
REASONING_MODES = {True: "open", False: "off", "open": "open", "optional": "optional", "off": "off"}


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str = ""  # JSON object text, as OpenAI sends it (complete once the call is closed)
    closed: bool = False

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """A piece of a streamed call: the first carries its id and name; the `arguments` of all concatenate
    to the call's JSON object text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class _Tool:
    """A listed tool: its argument schemas, read once."""

    def __init__(self, fn: dict):
        try:
            self.schema = Schema(fn.get("parameters") or {}, "parameters")
            props, _, self.extra = self.schema.object_view()
        except SchemaError:  # refused at the request already; typed as "any JSON" if it ever gets here
            self.schema, props, self.extra = Schema({}, "parameters"), [], None
        self.props = dict(props)

    def _node(self, key: str):
        pointer = self.props.get(key, self.extra)
        return None if pointer is None else self.schema.node(pointer)

    def is_raw(self, key: str) -> bool:
        """Whether GLM writes this argument raw (its schema admits only strings)."""
        node = self._node(key)
        return node is not None and self.schema.is_string(node)

    def value(self, key: str, text: str):
        return self.schema.value(text, self._node(key))


@dataclass
class _OpenCall:
    """The call being parsed: where in its body the parser is, and what of its arguments was sent."""

    out: ToolCallOut
    tool: _Tool
    index: int
    origin: str  # the mode to return to: "content" or "reasoning"
    phase: str = "between"  # between pairs | key | after_key | value
    key: str = ""
    raw_key: str = ""  # `<arg_key>K</arg_key>` as written, text again if no value follows
    raw: bool = False  # the value being read is a plain string (streamed as it arrives)
    pairs: int = 0


class ChatOutputParser:
    def __init__(self, thinking: bool | str, tools: list[dict] | None):
        if thinking not in REASONING_MODES:
            raise ValueError(f"thinking must be one of {sorted(map(str, REASONING_MODES))}, got {thinking!r}")
        self.mode = {"open": "reasoning", "optional": "maybe", "off": "content"}[REASONING_MODES[thinking]]
        self.tools = {t["function"]["name"]: _Tool(t["function"]) for t in tools or []}
        self.buf = ""
        self.space = ""  # whitespace seen right before a <tool_call>, kept if it is not a call
        self.started = False  # whether the start of the reasoning has been looked at
        self.origin = "content"  # where a <tool_call> being looked at was written
        self.late_close = False  # a call ended the reasoning: a </think> after the calls is dropped
        self.call: _OpenCall | None = None
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
        while getattr(self, f"_{self.mode}")(out, final):
            pass
        self.reasoning += out.reasoning
        self.content += out.content
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
        if k >= 0:  # maybe a call before </think>: it ends the reasoning if it is one
            body = self.buf[:k].rstrip()
            out.reasoning += body
            self.space, self.buf = self.buf[len(body):k], self.buf[k:]
            self.mode, self.origin = "head", "reasoning"
            return True
        text = self._safe((THINK_CLOSE, CALL_OPEN) if self.tools else (THINK_CLOSE,), final)
        if self.tools and not final:  # hold trailing whitespace until we know whether a call follows
            body = text.rstrip()
            self.buf = text[len(body):] + self.buf
            text = body
        out.reasoning += text
        return False

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
        if i >= 0:  # whitespace right before a call is layout, not content (unless it is no call)
            body = self.buf[:i].rstrip()
            out.content += body
            self.space, self.buf = self.buf[len(body):i], self.buf[i:]
            self.mode, self.origin = "head", "content"
            return True
        text = self._safe((CALL_OPEN,), final)
        body = text.rstrip()
        if final:  # trailing whitespace after calls is layout too
            out.content += body if self.calls else text
        else:  # hold trailing whitespace until we know whether a call follows
            out.content += body
            self.buf = text[len(body):] + self.buf
        return False

    def _head(self, out: Delta, final: bool) -> bool:
        """buf starts with <tool_call>: a call once its name is complete and names a listed tool."""
        rest = self.buf[len(CALL_OPEN):]
        ends = [j for j in (rest.find(KEY_OPEN), rest.find(CALL_CLOSE)) if j >= 0]
        if ends:
            name = rest[: min(ends)].strip()
            if name in self.tools:
                self._open_call(name, out)
                self.buf, self.mode = rest[min(ends):], "call"
                return True
        elif not final and self._may_be_name(rest):
            return False
        # not a call: the <tool_call> (and the whitespace before it) is text where it was written
        text = self.space + CALL_OPEN
        if self.origin == "reasoning":
            out.reasoning += text
        else:
            out.content += text
            self.late_close = False
        self.buf, self.space, self.mode = rest, "", self.origin
        return True

    def _may_be_name(self, rest: str) -> bool:
        """Whether `rest` (the text after <tool_call>, no <arg_key> or </tool_call> in it yet) may still
        become a listed tool's name followed by one of them."""
        keep = max(_partial_suffix(rest, KEY_OPEN), _partial_suffix(rest, CALL_CLOSE))
        core = rest[: len(rest) - keep]
        name = core.strip()
        if not name:
            return True
        if keep or core.rstrip() != core:  # only a complete name comes before whitespace or a marker
            return name in self.tools
        return any(t.startswith(name) for t in self.tools)

    def _open_call(self, name: str, out: Delta) -> None:
        call = ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        if self.origin == "reasoning":  # the call ends the reasoning
            self.origin, self.late_close = "content", True
        self.call = _OpenCall(call, self.tools[name], len(self.calls) - 1, self.origin)
        self.space = ""
        out.calls.append(CallDelta(self.call.index, "", call.id, name))
        self._send(out, "{")

    def _send(self, out: Delta, text: str) -> None:
        """Stream a piece of the open call's arguments."""
        if not text:
            return
        self.call.out.arguments += text
        last = out.calls[-1] if out.calls else None
        if last is not None and last.index == self.call.index:
            last.arguments += text
        else:
            out.calls.append(CallDelta(self.call.index, text))

    def _call(self, out: Delta, final: bool) -> bool:
        c = self.call
        return getattr(self, f"_call_{c.phase}")(c, out, final)

    def _call_between(self, c: _OpenCall, out: Delta, final: bool) -> bool:
        head = self.buf.lstrip()
        for marker, phase in ((KEY_OPEN, "key"), (CALL_CLOSE, None)):
            if head.startswith(marker):
                self.buf = head[len(marker):]
                if phase is None:
                    self._close_call(out)
                else:
                    c.phase, c.raw_key = phase, marker
                return True
        if not final and (KEY_OPEN.startswith(head) or CALL_CLOSE.startswith(head)):
            return False  # whitespace, or the start of a marker
        if final and (not head or KEY_OPEN.startswith(head) or CALL_CLOSE.startswith(head)):
            self.buf = ""  # the turn ended inside the call: it keeps what arrived
        self._close_call(out)  # anything else ends the call; it is text again
        return True

    def _call_key(self, c: _OpenCall, out: Delta, final: bool) -> bool:
        i, j = self.buf.find(KEY_CLOSE), self.buf.find(CALL_CLOSE)
        if j >= 0 and (i < 0 or j < i):  # the call closed inside a key: the key is dropped
            self.buf = self.buf[j + len(CALL_CLOSE):]
            self._close_call(out)
            return True
        if i < 0:
            if final:
                self.buf = ""
                self._close_call(out)
                return True
            return False
        c.key, c.raw_key = self.buf[:i].strip(), c.raw_key + self.buf[: i + len(KEY_CLOSE)]
        self.buf, c.phase = self.buf[i + len(KEY_CLOSE):], "after_key"
        return True

    def _call_after_key(self, c: _OpenCall, out: Delta, final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(VALUE_OPEN):
            self.buf, c.phase, c.raw = head[len(VALUE_OPEN):], "value", c.tool.is_raw(c.key)
            if c.raw:  # a plain string: its key now, its text as it arrives
                self._send(out, self._key_prefix(c) + '"')
            return True
        if not final and VALUE_OPEN.startswith(head):
            return False
        if final and VALUE_OPEN.startswith(head):
            self.buf = ""
        else:  # no value follows the key: the call ends, the key is text again
            self.buf = c.raw_key + self.buf
        self._close_call(out)
        return True

    def _call_value(self, c: _OpenCall, out: Delta, final: bool) -> bool:
        i, j = self.buf.find(VALUE_CLOSE), self.buf.find(CALL_CLOSE)
        end = min(x for x in (i, j) if x >= 0) if max(i, j) >= 0 else -1
        if end < 0 and not final:
            if c.raw:  # stream what cannot be the start of a marker
                keep = max(_partial_suffix(self.buf, VALUE_CLOSE), _partial_suffix(self.buf, CALL_CLOSE))
                self._send(out, _escaped(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False  # any other value waits for its end (typed as a whole)
        text = self.buf if end < 0 else self.buf[:end]
        if c.raw:
            self._send(out, _escaped(text) + '"')
        elif end >= 0:  # a value cut off by the end of the turn cannot be typed: it is dropped
            value = json.dumps(c.tool.value(c.key, text), ensure_ascii=False)
            self._send(out, self._key_prefix(c) + value)
        c.pairs += 1
        closes = end < 0 or end == j
        self.buf = "" if end < 0 else self.buf[end + len(CALL_CLOSE if closes else VALUE_CLOSE):]
        if closes:
            self._close_call(out)
        else:
            c.phase = "between"
        return True

    @staticmethod
    def _key_prefix(c: _OpenCall) -> str:
        return (", " if c.pairs else "") + json.dumps(c.key, ensure_ascii=False) + ": "

    def _close_call(self, out: Delta) -> None:
        self._send(out, "}")
        self.call.out.closed = True
        self.mode, self.call = self.call.origin, None

    def _safe(self, markers: tuple[str, ...], final: bool) -> str:
        """Take the buffer except a tail that may be the start of one of `markers`."""
        keep = 0 if final else max(_partial_suffix(self.buf, m) for m in markers)
        text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return text

    def _take_all(self) -> str:
        text, self.buf = self.buf, ""
        return text

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


def _escaped(text: str) -> str:
    """`text` as it appears inside a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
