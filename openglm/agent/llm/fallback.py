"""Primary + fallback model: the runtime's one fallback. The fallback answers when the primary raises
ModelError (or first, while the primary's endpoint is known to be down).

`answer(ask)` is the switch itself, with `ask(model)` asking one model: `query` asks each once; the
resilience layer passes an `ask` that first retries a model with backoff (the ladder's L1), so the
fallback answers at the ladder's L2.
"""

from __future__ import annotations

from typing import Callable

from openglm.agent.llm.base import Model, ModelError, ModelResponse


class FallbackModel(Model):
    def __init__(self, primary: Model, fallback: Model):
        self.primary, self.fallback = primary, fallback
        self.name = f"{primary.name}|{fallback.name}"

    def query(self, messages, tools=None) -> ModelResponse:
        return self.answer(lambda model: model.query(messages, tools))

    def answer(self, ask: Callable[[Model], ModelResponse], prefer_fallback: bool = False,
               on_switch: Callable[[int], None] | None = None) -> ModelResponse:
        """`ask(primary)`, then `ask(fallback)` when it raises ModelError (the other way round with
        `prefer_fallback`); `on_switch(1)` is told before the second model is asked."""
        order = [("fallback", self.fallback), ("primary", self.primary)] if prefer_fallback else \
            [("primary", self.primary), ("fallback", self.fallback)]
        (first_role, first), (second_role, second) = order
        try:
            return ask(first)
        except ModelError as first_error:
            if on_switch is not None:
                on_switch(1)
            try:
                return ask(second)
            except ModelError as second_error:
                raise ModelError(f"{first_role} failed ({first_error}); {second_role} failed ({second_error})") \
                    from second_error
