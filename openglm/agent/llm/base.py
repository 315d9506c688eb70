"""Model access: one `query(messages, tools) -> ModelResponse` interface for every backend."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field


class ModelError(RuntimeError):
    """The model could not answer (network, HTTP error, bad reply, script exhausted)."""


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

    def to_message(self) -> dict:
        msg = {"role": "assistant", "content": self.content}
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


class Model:
    """Interface. `name` is recorded with every response."""

    name: str = "model"

    def query(self, messages: list[dict], tools: list[dict] | None = None) -> ModelResponse:
        raise NotImplementedError


def estimate_tokens(messages: list[dict]) -> int:
    """Cheap token estimate (~4 characters a token) for context management and replayed turns."""
    return sum(len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls", ""))) for m in messages) // 4 + 1
