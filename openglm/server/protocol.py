"""OpenAI request bodies (pydantic). Unknown fields are accepted and ignored, as OpenAI clients send
extras; known fields are type-checked strictly and range-checked, and every violation becomes a 400."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

Number = Union[StrictInt, float]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    seed: StrictInt | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: StrictInt = Field(default=-1, ge=-1)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Number = Field(default=1.0, gt=0.0)
    min_tokens: StrictInt = Field(default=0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False

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
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
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
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True

    def rendered_messages(self) -> list[dict]:
        # GLM has no tool/developer roles: tool results are observations, developer text is system text
        alias = {"tool": "observation", "function": "observation", "developer": "system"}
        return [{"role": alias.get(m.role, m.role), "content": m.text()} for m in self.messages]
