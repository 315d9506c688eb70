"""Primary + fallback model: the fallback answers when the primary raises ModelError."""

from __future__ import annotations

from openglm.agent.llm.base import Model, ModelError, ModelResponse


class FallbackModel(Model):
    def __init__(self, primary: Model, fallback: Model):
        self.primary, self.fallback = primary, fallback
        self.name = f"{primary.name}|{fallback.name}"

    def query(self, messages, tools=None) -> ModelResponse:
        try:
            return self.primary.query(messages, tools)
        except ModelError as first:
            try:
                return self.fallback.query(messages, tools)
            except ModelError as second:
                raise ModelError(f"primary failed ({first}); fallback failed ({second})") from second
