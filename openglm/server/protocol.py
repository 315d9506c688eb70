"""OpenAI request bodies (pydantic). Unknown fields are accepted and ignored, as OpenAI clients send
extras; known fields are type-checked strictly and range-checked, and every violation becomes a 400."""

from __future__ import annotations

import json
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


# ---- chat messages, tools and output constraints (the chat protocol; see docs/serving.md) ----------
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "video_url": "video", "video": "video"}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str = "{}"  # OpenAI sends the arguments as a JSON string

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v):
        try:
            parsed = json.loads(v or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be a JSON object string ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object string")
        return v or "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # SDKs replay response messages with extra null fields (refusal, audio, ...): null extras are fine
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        # A clear refusal of image/video parts (GLM-5.3-Flash checkpoints carry a vision tower openglm does not run)
        for part in v if isinstance(v, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:
                raise PydanticCustomError("media_input", "{media} input is not supported for this checkpoint: "
                                          "openglm runs the text model only (content parts of type 'text')",
                                          {"media": MEDIA_PARTS[kind]})
        return v

    @model_validator(mode="after")
    def _known_fields(self):
        bad = [k for k, v in (self.model_extra or {}).items() if v is not None]
        if bad:
            raise ValueError(f"unsupported message field(s) {', '.join(bad)}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object, for its JSON layout options only (the constraint itself comes
    from `response_format` / `tools`; any other key is a 400)."""
    model_config = ConfigDict(extra="forbid")
    whitespace_pattern: str | None = Field(default=None, min_length=1, max_length=256)
    disable_any_whitespace: StrictBool | None = None


class ChatTemplateKwargs(BaseModel):
    """The template switches openglm honours (GLM's); any other key is a 400, not a silent no-op."""
    model_config = ConfigDict(extra="forbid")
    enable_thinking: StrictBool = True
    clear_thinking: StrictBool = True


# Fields of vLLM's / OpenAI's chat request that this server does not implement: sent with a value,
# they are a 400 naming the field (docs/serving.md lists every field and what openglm does with it).
UNSUPPORTED_CHAT_FIELDS = (
    "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
    "best_of", "use_beam_search", "length_penalty", "prompt_logprobs", "truncate_prompt_tokens",
    "continue_final_message", "echo", "documents", "chat_template", "mm_processor_kwargs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "bad_words", "allowed_token_ids", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "kv_transfer_params", "vllm_xargs", "reasoning_effort", "thinking_token_budget",
    "skip_special_tokens", "spaces_between_special_tokens", "priority", "cache_salt", "prompt_embeds",
)


def unsupported_chat_fields(body: dict) -> list[str]:
    """The unimplemented fields that `body` sets to something other than null/false/empty."""
    return [k for k in UNSUPPORTED_CHAT_FIELDS if body.get(k) not in (None, False, [], {}, "")]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: ChatTemplateKwargs = Field(default_factory=ChatTemplateKwargs)

    @model_validator(mode="before")
    @classmethod
    def _honoured_fields_only(cls, body):
        if isinstance(body, dict):
            bad = unsupported_chat_fields(body)
            if bad:
                raise ValueError(f"openglm does not support the field(s) {', '.join(bad)}")
        return body

    @model_validator(mode="after")
    def _consistent(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs at least one tool")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise ValueError("response_format: type 'json_schema' needs a json_schema object")
        if rf is not None and rf.type != "text" and self.forced_tool_call():
            raise ValueError("response_format: cannot be combined with a required or named tool_choice")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: 'auto' with tools, 'none' without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    def forced_tool_call(self) -> bool:
        choice = self.effective_tool_choice()
        return choice == "required" or isinstance(choice, NamedToolChoice)

    def constrained(self) -> bool:
        """Whether the answer must match a grammar (structured.py): a required or named tool call, or JSON."""
        return self.forced_tool_call() or (self.response_format is not None and self.response_format.type != "text")

    def template_messages(self) -> list[dict]:
        """The messages whole, as the chat template receives them (OpenAI field names)."""
        keep = set(ChatMessage.model_fields)
        return [{k: v for k, v in m.model_dump(exclude_none=True).items() if k in keep} for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools the template lists: none when tool_choice is 'none' (the model must not call)."""
        if not self.tools or self.effective_tool_choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
