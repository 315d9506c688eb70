"""vLLM's `/tokenize` and `/detokenize`: the token ids this server computes for a prompt or a conversation,
and the text of token ids.

- `/tokenize` with `prompt` (a string): its ids as `/v1/completions` reads it (`add_special_tokens: true`
  prefixes GLM's `[gMASK]<sop>`); with `messages` (a chat request's fields: `tools`,
  `chat_template_kwargs`, `thinking`, `add_generation_prompt`, ...): the ids of the prompt
  `/v1/chat/completions` would render for it. Answers `{"count", "max_model_len", "tokens", "token_strs"}`
  (`token_strs` with `return_token_strs: true`). Rendering and tokenising run in the prepare workers, within
  their budgets: a prompt that cannot fit the context is a 400 (`context_length_exceeded`), not tokenised whole.
- `/detokenize` with `tokens`: `{"prompt": text}`; an id outside the vocabulary is a 400.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from openglm.server.errors import APIError, validation_message
from openglm.server.protocol import MAX_ID_CHARS, ChatCompletionRequest

TOKENIZE_ONLY = ("prompt", "add_special_tokens", "return_token_strs")


class TokenizeOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class TokenizePrompt(TokenizeOptions):
    prompt: str


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def parsed(model, body):
    """`body` validated as `model` (a 400 naming the field)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param="body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(400, message, param=param) from None


def tokenize_request(body) -> tuple[TokenizeOptions, ChatCompletionRequest | None]:
    """The options, and (with `messages`) the chat request whose prompt is wanted."""
    if isinstance(body, dict) and "messages" in body:
        if "prompt" in body:
            raise APIError(400, "give either prompt or messages, not both", param="prompt")
        chat = parsed(ChatCompletionRequest, {k: v for k, v in body.items() if k not in TOKENIZE_ONLY})
        return parsed(TokenizeOptions, body), chat
    return parsed(TokenizePrompt, body), None


def tokenize_body(ids: list[int], max_model_len: int, decode, token_strs: bool) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": [decode([i]) for i in ids] if token_strs else None}
