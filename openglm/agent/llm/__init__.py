"""Model backends for the agent: OpenAI-compatible chat, primary+fallback, replay (JSONL)."""

from __future__ import annotations

from openglm.agent.llm.base import ContextOverflowError, Model, ModelError, ModelResponse, ToolCall, estimate_tokens
from openglm.agent.llm.fallback import FallbackModel
from openglm.agent.llm.replay import ReplayModel


def build_model(spec: dict) -> Model:
    """From a config dict: {"replay": path} or {"base_url", "model", "api_key"}; optional "fallback": {...}."""
    if "replay" in spec:
        model: Model = ReplayModel(spec["replay"], calls_log=spec.get("calls_log"))
    elif "base_url" in spec and "model" in spec:
        from openglm.agent.llm.openai_chat import OpenAIChatModel

        options = {k: spec[k] for k in ("use_tools", "context_window", "max_tokens", "temperature", "tool_choice",
                                         "extra_body", "clear_thinking", "timeout") if k in spec}
        model = OpenAIChatModel(spec["base_url"], spec["model"], api_key=spec.get("api_key"), **options)
    else:
        raise ValueError(f"model spec needs 'replay' or 'base_url' + 'model', got keys {sorted(spec)}")
    if spec.get("fallback"):
        model = FallbackModel(model, build_model(spec["fallback"]))
    return model


__all__ = ["ContextOverflowError", "FallbackModel", "Model", "ModelError", "ModelResponse", "ReplayModel", "ToolCall", "build_model",
           "estimate_tokens"]
