"""OpenAI request bodies (pydantic). Unknown fields are accepted and ignored, as OpenAI clients send
extras; known fields are type-checked strictly and range-checked, and every violation becomes a 400."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from openglm.engine import sampling_params as limits

# JSON numbers only: "0", true and null are not numbers (lax pydantic would coerce the first two)
Number = Union[StrictInt, StrictFloat]
MAX_ID_CHARS = 256  # model / user strings


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


def lone_surrogate_path(value, path: str = "") -> str | None:
    """The JSON path of the first string holding a lone UTF-16 surrogate (JSON allows "\\ud800";
    no tokenizer or UTF-8 encoder does), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        bad = lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
        if bad is not None:
            return bad
    return None


class _Sampling(BaseModel):
    """The sampling fields shared by both endpoints; bounds come from the engine's SamplingParams
    limits, so every accepted value samples cleanly."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=limits.MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Number = Field(default=0.0, ge=limits.PENALTY_RANGE[0], le=limits.PENALTY_RANGE[1])
    frequency_penalty: Number = Field(default=0.0, ge=limits.PENALTY_RANGE[0], le=limits.PENALTY_RANGE[1])
    seed: StrictInt | None = Field(default=None, ge=limits.SEED_RANGE[0], le=limits.SEED_RANGE[1])
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    # vLLM-style extras
    top_k: StrictInt = Field(default=-1, ge=-1, le=limits.MAX_TOP_K)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Number = Field(default=1.0, ge=limits.REPETITION_PENALTY_RANGE[0],
                                       le=limits.REPETITION_PENALTY_RANGE[1])
    min_tokens: StrictInt = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(default=None,
                                                                          max_length=limits.MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _encodable_strings(cls, data):
        bad = lone_surrogate_path(data)
        if bad is not None:  # a ValidationError (not ValueError) so that the error's loc names the field
            error = PydanticCustomError("lone_surrogate", "the string holds a lone UTF-16 surrogate (not valid "
                                                          "Unicode text)")
            raise ValidationError.from_exception_data(cls.__name__, [
                {"type": error, "loc": tuple(int(k) if k.isdigit() else k for k in bad.split(".")), "input": "?"}])
        return data

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and v != 0 and not limits.TEMPERATURE_FLOOR <= v <= limits.TEMPERATURE_MAX:
            raise ValueError(f"temperature must be 0 (greedy) or in [{limits.TEMPERATURE_FLOOR}, "
                             f"{limits.TEMPERATURE_MAX}]")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > limits.MAX_STOP_STRINGS or any(not s or len(s) > limits.MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop takes at most {limits.MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{limits.MAX_STOP_STRING_CHARS} characters")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, (list, str)) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "observation", "tool", "function", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True

    def rendered_messages(self) -> list[dict]:
        # GLM has no tool/developer roles: tool results are observations, developer text is system text
        alias = {"tool": "observation", "function": "observation", "developer": "system"}
        return [{"role": alias.get(m.role, m.role), "content": m.text()} for m in self.messages]
