"""A chat request's thinking: on or off, whether earlier reasoning is cleared, and its budget of tokens.

Where each comes from, first match wins (a request that sets two of its own sources to different
answers is a 400 naming the later one):
- on/off: `chat_template_kwargs.enable_thinking`, Z.ai's `thinking: {"type": "enabled" | "disabled"}`,
  OpenAI's `reasoning_effort` (`"none"` is off, any other level on), the server's
  `--default-chat-template-kwargs`, else on (as GLM ships).
- clear: `chat_template_kwargs.clear_thinking`, `thinking.clear_thinking`, the server's default, else on.
- the budget (reasoning tokens after which `</think>` is forced, engine/thinking.py): the request's
  `thinking_token_budget` (vLLM's field), the level of `reasoning_effort` (LiteLLM's budgets for it),
  the server's `--thinking-token-budget`; without any of them, a request whose answer is constrained
  (a forced tool call, `response_format`) thinks for at most half its `max_tokens`, so that its structure
  always has room; an unconstrained one thinks without a limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from openglm.server.errors import APIError
from openglm.server.protocol import ChatCompletionRequest, ChatTemplateKwargs

# reasoning_effort -> thinking budget in tokens (None: thinking off); LiteLLM maps the levels to these budgets
EFFORT_BUDGETS = {"none": None, "minimal": 128, "low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192}


@dataclass(frozen=True)
class ThinkingChoice:
    enabled: bool
    clear: bool
    budget: int | None  # None: no limit (a constrained request still gets one: `budget_for`)

    def budget_for(self, constrained: bool, max_tokens: int) -> int | None:
        if self.budget is None and constrained:
            return max_tokens // 2
        return self.budget


def resolve(req: ChatCompletionRequest, defaults: ChatTemplateKwargs, default_budget: int | None) -> ThinkingChoice:
    """The request's thinking (see the module docstring); a 400 when its own fields disagree."""
    kw, zai, effort = req.chat_template_kwargs, req.thinking, req.reasoning_effort
    sources = [("chat_template_kwargs.enable_thinking", kw.enable_thinking),
               ("thinking.type", None if zai is None else zai.type == "enabled"),
               ("reasoning_effort", None if effort is None else effort != "none")]
    given = [(name, on) for name, on in sources if on is not None]
    for name, on in given[1:]:
        if on != given[0][1]:
            raise APIError(400, f"{name} turns thinking {'on' if on else 'off'} but {given[0][0]} turns it "
                                f"{'on' if given[0][1] else 'off'}: send one of them", param=name)
    enabled = given[0][1] if given else (True if defaults.enable_thinking is None else defaults.enable_thinking)
    clear = next((c for c in (kw.clear_thinking, zai and zai.clear_thinking, defaults.clear_thinking)
                  if c is not None), True)
    budget = req.thinking_token_budget
    if budget is None and effort is not None:
        budget = EFFORT_BUDGETS[effort]
    return ThinkingChoice(enabled, clear, default_budget if budget is None else budget)
