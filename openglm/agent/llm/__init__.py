"""LLM clients for the agent: OpenAI-compatible chat, primary+fallback, replay (JSONL); `ModelSpec`
says which one a task talks to."""

from __future__ import annotations

from dataclasses import dataclass, fields

from openglm.agent.llm.base import ContextOverflowError, Model, ModelError, ModelResponse, ToolCall, estimate_tokens
from openglm.agent.llm.fallback import FallbackModel
from openglm.agent.llm.openai_chat import OpenAIChatModel
from openglm.agent.llm.replay import ReplayModel
from openglm.util.strict import check_keys


@dataclass
class ModelSpec:
    """A replay script, or an OpenAI-compatible endpoint (base URL + model + key); optionally a fallback."""

    replay: str = ""  # JSONL of scripted assistant turns (tests, demos)
    calls_log: str = ""  # replay only: one line per model call is appended here
    base_url: str = ""  # e.g. http://127.0.0.1:8000/v1
    model: str = ""  # the model name at base_url
    api_key: str | None = None
    use_tools: bool = True  # send tool specs (off: the model answers with ```bash blocks)
    # OpenAI endpoints: context management and request options (docs/agent.md)
    context_window: int | None = None  # tokens; None: the endpoint's /models max_model_len, else 8192
    max_tokens: int = 1024  # reply cap; every request sends max_tokens, at most what the window leaves
    temperature: float = 0.0
    tool_choice: str | None = None  # e.g. "required" for a model that must always act
    extra_body: dict | None = None  # merged into each request (e.g. chat_template_kwargs)
    clear_thinking: bool = True  # earlier turns' reasoning_content only after the last user message
    timeout: float = 600.0  # seconds per request
    fallback: ModelSpec | None = None  # answers when this one raises ModelError

    @classmethod
    def from_dict(cls, raw: dict) -> ModelSpec:
        """From JSON (`AgentConfig.model`, a task's `model`); unknown keys are errors naming them."""
        if not isinstance(raw, dict):
            raise ValueError(f"model spec: expected an object, got {type(raw).__name__}")
        check_keys(raw, cls, "key(s) of the model spec")
        fallback = raw.get("fallback")
        return cls(**{**raw, "fallback": cls.from_dict(fallback) if fallback else None})

    def to_dict(self) -> dict:
        """The keys that are set (what a config file or a task record holds)."""
        defaults = {f.name: f.default for f in fields(self)}
        out = {k: v for k, v in vars(self).items() if v not in ("", None) and k != "fallback" and v != defaults[k]}
        return {**out, **({"fallback": self.fallback.to_dict()} if self.fallback else {})}


def build_model(spec: ModelSpec | dict) -> Model:
    """The client a spec describes; a dict is read with `ModelSpec.from_dict`."""
    spec = ModelSpec.from_dict(spec) if isinstance(spec, dict) else spec
    if spec.replay:
        model: Model = ReplayModel(spec.replay, calls_log=spec.calls_log or None)
    elif spec.base_url and spec.model:
        model = OpenAIChatModel(spec.base_url, spec.model, api_key=spec.api_key, use_tools=spec.use_tools,
                                context_window=spec.context_window, max_tokens=spec.max_tokens,
                                temperature=spec.temperature, tool_choice=spec.tool_choice,
                                extra_body=spec.extra_body, clear_thinking=spec.clear_thinking, timeout=spec.timeout)
    else:
        raise ValueError(f"model spec needs 'replay' or 'base_url' + 'model', got keys {sorted(spec.to_dict())}")
    if spec.fallback:
        model = FallbackModel(model, build_model(spec.fallback))
    return model


__all__ = ["ContextOverflowError", "FallbackModel", "Model", "ModelError", "ModelResponse", "ModelSpec",
           "OpenAIChatModel", "ReplayModel", "ToolCall", "build_model", "estimate_tokens"]
