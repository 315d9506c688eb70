"""OpenAI request bodies (pydantic). Every field is known: a field openglm implements is type-checked strictly
and range-checked; a field of vLLM's or OpenAI's API that openglm does not implement is a 400 naming it when
it is set; a few bookkeeping fields (`store`, `metadata`, ...) are accepted with no effect; any other field,
at any depth, is a 400 naming it. Every violation becomes a 400."""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from openglm.engine import sampling_params as limits

# JSON numbers only: "0", true and null are not numbers (lax pydantic would coerce the first two)
Number = Union[StrictInt, StrictFloat]
MAX_ID_CHARS = 256  # model / user strings


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # accepted, no effect (vLLM's; usage comes at the end)


def field_error(loc: tuple, message: str, kind: str = "invalid_field"):
    """A ValidationError whose location is `loc`, so that the 400 names that field in `param`."""
    error = PydanticCustomError(kind, "{message}", {"message": message})
    return ValidationError.from_exception_data("request", [{"type": error, "loc": loc, "input": "?"}])


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


# Fields accepted on both endpoints with no effect on the answer (bookkeeping some clients send).
IGNORED_FIELDS = ("store", "metadata", "service_tier", "request_id")


def unset(value) -> bool:
    """Whether a field's value leaves an unimplemented feature off (null, false, empty)."""
    return value in (None, False, [], {}, "")


class _Sampling(BaseModel):
    """The sampling fields shared by both endpoints; bounds come from the engine's SamplingParams
    limits, so every accepted value samples cleanly."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()  # this endpoint's fields of vLLM/OpenAI that openglm does not implement

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
            raise field_error(tuple(int(k) if k.isdigit() else k for k in bad.split(".")),
                              "the string holds a lone UTF-16 surrogate (not valid Unicode text)", "lone_surrogate")
        if isinstance(data, dict):
            unsupported = [name for name in cls.UNSUPPORTED if not unset(data.get(name))]
            if unsupported:
                others = f" (nor {', '.join(unsupported[1:])})" if unsupported[1:] else ""
                raise field_error((unsupported[0],), f"openglm does not support this field{others}",
                                  "unsupported_field")
            data = {k: v for k, v in data.items() if k not in IGNORED_FIELDS and k not in cls.UNSUPPORTED}
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
    def _positive(cls, v, info):
        if v is not None and v <= 0:
            raise ValueError(f"{info.field_name} must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > limits.MAX_STOP_STRINGS or any(not s or len(s) > limits.MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop takes at most {limits.MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{limits.MAX_STOP_STRING_CHARS} characters")
        return stops


# Fields of vLLM's completions request that this server does not implement: sent with a value, they are a
# 400 naming the field (docs/serving.md lists every field and what openglm does with it).
UNSUPPORTED_COMPLETION_FIELDS = (
    "best_of", "use_beam_search", "length_penalty", "logit_bias", "suffix", "prompt_logprobs",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens",
    "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "priority", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "prompt_embeds",
)


class CompletionRequest(_Sampling):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = UNSUPPORTED_COMPLETION_FIELDS
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
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


# content parts of other kinds (OpenAI's chat and Responses names): a 400 saying what the model cannot read (a
# GLM-5.3-Flash checkpoint carries a vision tower that openglm keeps but does not run)
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
               "audio": "audio", "file": "file", "input_file": "file", "video_url": "video", "video": "video"}


def media_refusal(kind: str) -> str:
    return (f"{MEDIA_PARTS[kind]} input is not supported for this checkpoint (a {kind!r} part): openglm runs the "
            "text model only (content parts of type 'text')")


def unreadable_part(messages) -> tuple[tuple, str] | None:
    """(location, reason) of the first message content part that is not text, or None."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PARTS:
                return ("messages", i, "content", j), media_refusal(kind)
    return None


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
    reasoning: str | None = None  # vLLM's name for reasoning_content: either is read

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
    """The template switches openglm honours (GLM's); any other key is a 400, not a silent no-op. Unset: the
    server's `--default-chat-template-kwargs`, else the template's default (on)."""
    model_config = ConfigDict(extra="forbid")
    enable_thinking: StrictBool | None = None
    clear_thinking: StrictBool | None = None


class Thinking(BaseModel):
    """Z.ai's `thinking` field: GLM's thinking on or off (and whether earlier turns' reasoning is cleared)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled"]
    clear_thinking: StrictBool | None = None


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


# Fields of vLLM's / OpenAI's chat request that this server does not implement: sent with a value,
# they are a 400 naming the field (docs/serving.md lists every field and what openglm does with it).
UNSUPPORTED_CHAT_FIELDS = (
    "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
    "best_of", "use_beam_search", "length_penalty", "prompt_logprobs", "truncate_prompt_tokens",
    "continue_final_message", "echo", "documents", "chat_template", "mm_processor_kwargs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "bad_words", "allowed_token_ids", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "kv_transfer_params", "vllm_xargs", "skip_special_tokens", "spaces_between_special_tokens",
    "priority", "cache_salt", "prompt_embeds",
)


class ChatCompletionRequest(_Sampling):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = UNSUPPORTED_CHAT_FIELDS
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
    # thinking (server/thinking.py): Z.ai's switch, OpenAI's effort, vLLM's budget of reasoning tokens
    thinking: Thinking | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion_tokens(cls, v, info):
        return cls._positive(v, info)

    @model_validator(mode="before")
    @classmethod
    def _readable_parts_only(cls, body):
        if isinstance(body, dict):
            part = unreadable_part(body.get("messages"))
            if part is not None:
                raise field_error(*part, "unsupported_content")
        return body

    @model_validator(mode="after")
    def _consistent(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error(("tools",), "function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise field_error(("tool_choice",), f"no tool named {self.tool_choice.function.name!r} in tools")
        if self.tool_choice == "required" and not names:
            raise field_error(("tool_choice",), "'required' needs at least one tool")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise field_error(("response_format",), "type 'json_schema' needs a json_schema object")
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
        """Whether the answer must match a grammar (structured.py): a required or named tool call, or JSON.
        A forced call wins over `response_format` (which then shapes a later turn's answer, as in agent loops)."""
        return self.forced_tool_call() or (self.response_format is not None and self.response_format.type != "text")

    def template_messages(self) -> list[dict]:
        """The messages whole, as the chat template receives them (OpenAI field names; `reasoning` read as
        `reasoning_content`)."""
        keep = set(ChatMessage.model_fields) - {"reasoning"}
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            if m.reasoning_content is None and m.reasoning is not None:
                d["reasoning_content"] = m.reasoning
            out.append({k: v for k, v in d.items() if k in keep})
        return out

    def template_tools(self) -> list[dict] | None:
        """The tools the template lists: none when tool_choice is 'none' (the model must not call)."""
        if not self.tools or self.effective_tool_choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]
