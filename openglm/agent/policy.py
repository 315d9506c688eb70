"""The agent policy interface and the default policy: a plain tool-calling loop.

A policy decides what to ask the model next and how to read its answer. Its phase is explicit
state: `after_step` may return ("phase", {"phase": name, "data": {...}}) events, committed with the
step and replayed into `state.phase` / `state.phase_data` on resume.
"""

from __future__ import annotations

import re

from openglm.agent.llm.base import ModelResponse, ToolCall, estimate_tokens

SYSTEM_PROMPT = """You are an autonomous software engineer working in a workspace directory.
Use the tools to inspect and change files and to run commands. Work step by step; each step's
changes are snapshotted. When the objective is met and the deliverables exist, call `submit`.
If you cannot continue without a human decision, call `ask_user`."""


class Policy:
    """Interface; subclass ToolCallingPolicy to change one piece."""

    name = "policy"

    def initial_messages(self, task) -> list[dict]:
        raise NotImplementedError

    def prepare(self, ctx, state, tools: list[dict]) -> tuple[list[dict], list[dict], list[tuple[str, dict]]]:
        """(messages, tools, events to record with the model call, e.g. a condensation). The run applies
        those events to the state as it records them; a policy that needs one applied to build the
        messages applies it itself (`state.apply`: the events it returns apply the same way again)."""
        raise NotImplementedError

    def actions(self, response: ModelResponse) -> list[tuple[ToolCall, bool]]:
        """The tool calls to run, each with `as_user` (observation sent as a user message)."""
        raise NotImplementedError

    def after_step(self, ctx, state, record) -> list[tuple[str, dict]]:
        return []


class ToolCallingPolicy(Policy):
    name = "tool-calling"

    def __init__(self, context_limit: int = 100_000, keep_recent_steps: int = 5, system_prompt: str = SYSTEM_PROMPT):
        self.context_limit = context_limit
        self.keep_recent_steps = keep_recent_steps
        self.system_prompt = system_prompt

    def initial_messages(self, task) -> list[dict]:
        deliverables = task.parsed_constraints.deliverables
        text = f"Objective:\n{task.objective}"
        if deliverables:
            text += "\n\nDeliverables (checked when you submit):\n"
            text += "\n".join(f"- {d.describe()}" for d in deliverables)
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": text}]

    def prepare(self, ctx, state, tools):
        events = []
        messages = state.messages()
        upto = state.step - self.keep_recent_steps
        if estimate_tokens(messages) > 0.75 * self.context_limit and upto > max(state.condensed_upto, 0):
            # Older observations are shortened; the condensation is an event so a resume sees it too.
            before = estimate_tokens(messages)
            state.apply("condensation", state.step, {"upto_step": upto})
            messages = state.messages()
            events.append(("condensation", {"upto_step": upto, "tokens_before": before,
                                            "tokens_after": estimate_tokens(messages)}))
        return messages, tools, events

    def actions(self, response):
        # a reply cut off by max_tokens: whatever call it was writing is lost, and the model is told so
        cut = [(ToolCall(name="_no_action", arguments={"truncated": response.truncation or "max_tokens"}, id=""),
                True)] if response.truncated else []
        if response.tool_calls:
            return [(c, False) for c in response.tool_calls] + cut
        # Models served without tool support: a ```bash block is a shell call (mini-swe-agent style).
        blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", response.content or "", re.S)
        if blocks:
            return [(ToolCall(name="bash", arguments={"command": blocks[0].strip()}, id=""), True)] + cut
        return cut or [(ToolCall(name="_no_action", arguments={}, id=""), True)]
