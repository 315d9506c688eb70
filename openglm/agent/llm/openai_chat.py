"""OpenAI-compatible chat client: `openglm serve`, vLLM, or any provider (base URL + key + model)."""

from __future__ import annotations

import json

import httpx

from openglm.agent.llm.base import Model, ModelError, ModelResponse, ToolCall


class OpenAIChatModel(Model):
    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0,
                 temperature: float = 0.0, max_tokens: int | None = None, use_tools: bool = True):
        self.base_url = base_url.rstrip("/")
        self.name = model
        self.use_tools = use_tools
        self.params = {"temperature": temperature, **({"max_tokens": max_tokens} if max_tokens else {})}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)

    def query(self, messages, tools=None) -> ModelResponse:
        body = {"model": self.name, "messages": messages, **self.params}
        if tools and self.use_tools:
            body["tools"] = tools
        try:
            r = self.http.post(f"{self.base_url}/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise ModelError(f"{self.name} at {self.base_url}: {e}") from e
        if r.status_code != 200:
            raise ModelError(f"{self.name} at {self.base_url}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            data = r.json()
            msg = data["choices"][0]["message"]
            calls = [ToolCall(name=c["function"]["name"], arguments=_args(c["function"].get("arguments")),
                              id=c.get("id") or f"call_{i}") for i, c in enumerate(msg.get("tool_calls") or [])]
            usage = data.get("usage") or {}
            return ModelResponse(content=msg.get("content") or "", tool_calls=calls,
                                 prompt_tokens=usage.get("prompt_tokens", 0),
                                 completion_tokens=usage.get("completion_tokens", 0), model=data.get("model", self.name))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ModelError(f"{self.name}: malformed reply ({e}): {r.text[:500]}") from e


def _args(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": raw}
