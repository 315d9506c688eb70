"""The run's model and tools under the recovery ladder: the resilience layer's model and tool wrappers.

`ResilientModel` retries each model it asks while the ladder says L1 (exponential backoff); at L2 a
`FallbackModel` moves on to its other model (the runtime's one fallback); past that nothing in the
workspace helps, and the task pauses safely ("model unavailable") to resume later.
`ResilientTools` retries a command the timeout killed (a hung command may be a flaky one) while the
ladder says L1; after that the last result goes back to the step like any failed command.
"""

from __future__ import annotations

import time

from openglm.agent.llm import FallbackModel, Model, ModelError, ModelResponse
from openglm.agent.tools import Environment, ToolResult

from .guard import Guard
from .ladder import ClassifiedError, Escalation, retry_call


class ResilientModel:
    def __init__(self, inner: Model, guard: Guard, sleep=time.sleep):
        self.inner, self.guard, self.sleep = inner, guard, sleep
        self.name = inner.name

    def query(self, messages: list[dict], tools: list[dict] | None = None) -> ModelResponse:
        fallback = isinstance(self.inner, FallbackModel)
        try:
            if fallback:
                return self.inner.answer(lambda model: self._retried(model, messages, tools),
                                         prefer_fallback=self.guard.prefer_fallback, on_switch=self._switched)
            return self._retried(self.inner, messages, tools)
        except ModelError as exc:  # past L2: pause safely, resume later
            self.guard.call_ladder.abort("safe pause")
            tried = "retries and the fallback" if fallback else "retries (no fallback model configured)"
            raise ModelError(f"no model answered after {tried}: {exc}") from exc

    def _retried(self, model: Model, messages, tools) -> ModelResponse:
        """One model's answer, asked again while the ladder says L1; a ModelError once it says more."""
        try:
            return retry_call(lambda: model.query(messages, tools), self.guard.call_ladder, sleep=self.sleep,
                              can_rollback=False)
        except Escalation as esc:
            if isinstance(esc.error, ModelError):
                raise esc.error
            raise ModelError(f"{type(esc.error).__name__}: {esc.error}") from esc.error

    def _switched(self, to: int) -> None:
        self.guard.event("model_switch", {"to": to})


class CommandHung(ClassifiedError):
    """A command the timeout killed: a transient failure for the ladder."""

    def __init__(self, name: str, args: dict, result: ToolResult):
        super().__init__("transient", f"{name} hung: {str(args)[:200]}")
        self.result = result


class ResilientTools:
    def __init__(self, inner: Environment, guard: Guard, sleep=time.sleep):
        self.inner, self.guard, self.sleep = inner, guard, sleep

    def call(self, name: str, args: dict) -> ToolResult:
        if not self.guard.config.guard.tool_retry:
            return self.inner.call(name, args)
        try:
            return retry_call(lambda: self._finished(name, args), self.guard.call_ladder, sleep=self.sleep,
                              retry_on=(CommandHung,))
        except Escalation as esc:
            self.guard.call_ladder.abort("returned to the step")
            return esc.error.result

    def _finished(self, name: str, args: dict) -> ToolResult:
        result = self.inner.call(name, args)
        if result.meta.get("killed") == "timeout":
            raise CommandHung(name, args, result)
        return result
