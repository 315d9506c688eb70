"""Model access: one `query(messages, tools) -> ModelResponse` interface for every backend."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Protocol


class ModelError(RuntimeError):
    """The model could not answer (network, HTTP error, bad reply, script exhausted)."""


class ContextOverflowError(ModelError):
    """The conversation does not fit the model's context window even condensed: recoverable (the loop
    condenses the history and asks again; the ladder's `context_limit` class), not "unavailable"."""

    error_class = "context_limit"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:8])


@dataclass
class ModelResponse:
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    reasoning: str = ""  # the model's reasoning_content (GLM thinking), sent back per clear_thinking
    finish_reason: str = ""  # the endpoint's: "stop", "tool_calls", "length" (cut off by the reply cap), ...
    truncation: str = ""  # when cut off: what capped the reply, in words (the max_tokens setting, the window)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def to_message(self) -> dict:
        msg = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in self.tool_calls]
        return msg

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelResponse":
        calls = [ToolCall(**c) for c in d.get("tool_calls", [])]
        return cls(**{**d, "tool_calls": calls})


class Model(Protocol):
    """What the step loop asks for the next action. The clients (OpenAI-compatible, replay), FallbackModel
    and the hook layers' model wrappers are all Models; `name` is recorded with every response."""

    name: str = "model"

    def query(self, messages: list[dict], tools: list[dict] | None = None) -> ModelResponse:
        """The model's next turn for the conversation `messages`, offered `tools` (OpenAI tool specs).
        Raises ModelError when no answer comes (ContextOverflowError: the conversation does not fit)."""
        ...


def estimate_tokens(messages: list[dict]) -> int:
    """Cheap token estimate (~4 characters a token) for context management and replayed turns."""
    return sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls", ""))) for m in messages) // 4 + 1
