"""OpenAI-compatible chat client: `openglm serve`, vLLM, or any provider (base URL + key + model).

Context management, so a long task never overflows the endpoint's window:
- the window is the endpoint's (`/models` -> `max_model_len`, as openglm serve and vLLM report it) or
  `context_window` when given; every request sends `max_tokens` (at most `max_tokens`, at most what the
  window leaves after the prompt);
- the conversation is fitted to the window before sending: older tool/observation outputs are cut to a
  head and tail with a visible `[... N characters truncated ...]` marker, then the oldest whole turns
  (an assistant message with its tool replies) are dropped behind a visible note; the system prompt,
  the objective (first user message) and the latest turns are always kept, and every assistant
  tool call keeps its tool reply (OpenAI's ordering rules);
- `reasoning_content` of assistant turns is sent only after the last user message (GLM's
  `clear_thinking`), unless `clear_thinking=False`;
- a reply cut off by `max_tokens` (finish_reason "length") is marked `truncated`, with what capped it in
  `truncation`; a tool call cut inside its arguments is dropped (the loop tells the model why); when the
  window's share rather than `max_tokens` capped the reply, later requests leave the reply half the window;
- a 400 "context length exceeded" from the endpoint (the estimate was off) refits to half the budget and
  retries; when even that fails it raises `ContextOverflowError` (the ladder's `context_limit` class:
  condense and retry), not "model unavailable".
"""

from __future__ import annotations

import json

import httpx

from openglm.agent.llm.base import ContextOverflowError, Model, ModelError, ModelResponse, ToolCall

CHARS_PER_TOKEN = 3.0  # conservative: small BPE vocabularies average fewer characters a token than 4
KEEP_CHARS = 600  # of a truncated observation: head + tail kept


class OpenAIChatModel(Model):
    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0,
                 temperature: float = 0.0, max_tokens: int | None = None, use_tools: bool = True,
                 context_window: int | None = None, tool_choice: str | None = None, extra_body: dict | None = None,
                 clear_thinking: bool = True, keep_turns: int = 4):
        self.base_url = base_url.rstrip("/")
        self.name = model
        self.use_tools = use_tools
        self.temperature, self.max_tokens = temperature, max_tokens or 1024
        self.tool_choice, self.extra_body = tool_choice, dict(extra_body or {})
        self.clear_thinking, self.keep_turns = clear_thinking, keep_turns
        self._window = context_window
        self.reply_share = 4  # a reply gets at most 1/reply_share of the window (2 once a reply was cut by it)
        self.chars_per_token = CHARS_PER_TOKEN  # recalibrated from the endpoint's own prompt token counts
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)

    # ---- the window
    @property
    def context_window(self) -> int:
        if self._window is None:
            self._window = self._endpoint_window() or 8192
        return self._window

    def _endpoint_window(self) -> int | None:
        try:
            r = self.http.get(f"{self.base_url}/models")
            models = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        for m in models:
            if isinstance(m, dict) and m.get("id") == self.name and isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
        return None

    # ---- one call
    def query(self, messages, tools=None) -> ModelResponse:
        tools = tools if tools and self.use_tools else None
        budget = self.context_window
        tools_chars = len(json.dumps(tools or [], ensure_ascii=False))
        for attempt in range(3):
            cpt = self.chars_per_token
            reply_tokens = min(self.max_tokens, max(16, budget // self.reply_share))
            prompt_budget = budget - reply_tokens - int(tools_chars / cpt)
            fitted = fit_messages(messages, prompt_budget, self.keep_turns, self.clear_thinking, cpt)
            sent_chars = _chars(fitted) + tools_chars
            room = budget - int(sent_chars / cpt)
            body = {"model": self.name, "messages": fitted, "temperature": self.temperature,
                    "max_tokens": max(1, min(reply_tokens, room)), **self.extra_body}
            if tools:
                body["tools"] = tools
                if self.tool_choice:
                    body["tool_choice"] = self.tool_choice
            r = self._post(body)
            if r.status_code == 400 and "context_length_exceeded" in r.text:
                budget //= 2  # the estimate was optimistic: fit tighter and retry
                continue
            response = self._parse(r)
            if response.truncated:
                response.truncation = self._truncated(body["max_tokens"], budget)
            if response.prompt_tokens > 0:  # the endpoint's count: estimate with its ratio (10% margin)
                self.chars_per_token = min(CHARS_PER_TOKEN, 0.9 * sent_chars / response.prompt_tokens)
            return response
        raise ContextOverflowError(f"{self.name} at {self.base_url}: the conversation does not fit the "
                                   f"{self.context_window}-token context window even condensed "
                                   "(context length exceeded)")

    def _truncated(self, sent: int, window: int) -> str:
        """Why a reply was cut off at `sent` tokens, in words for the model and the log. When the window's
        share, not the max_tokens setting, was the cap, later requests leave the reply half the window."""
        if sent >= self.max_tokens:
            return f"the reply cap (max_tokens={self.max_tokens} in the model spec)"
        self.reply_share = 2
        return (f"the {sent} tokens the {window}-token context window left for the reply (max_tokens="
                f"{self.max_tokens}); later requests leave the reply up to half the window")

    def _post(self, body: dict) -> httpx.Response:
        try:
            return self.http.post(f"{self.base_url}/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise ModelError(f"{self.name} at {self.base_url}: {e}") from e

    def _parse(self, r: httpx.Response) -> ModelResponse:
        if r.status_code != 200:
            raise ModelError(f"{self.name} at {self.base_url}: HTTP {r.status_code}: {r.text[:500]}")
        try:
            data = r.json()
            choice = data["choices"][0]
            msg, finish = choice["message"], choice.get("finish_reason") or ""
            calls = [ToolCall(name=c["function"]["name"], arguments=_args(c["function"].get("arguments")),
                              id=c.get("id") or f"call_{i}") for i, c in enumerate(msg.get("tool_calls") or [])]
            if finish == "length":  # a call cut off inside its arguments is not run with half of them
                calls = [c for c in calls if "_raw" not in c.arguments]
            usage = data.get("usage") or {}
            return ModelResponse(content=msg.get("content") or "", tool_calls=calls,
                                 prompt_tokens=usage.get("prompt_tokens", 0),
                                 completion_tokens=usage.get("completion_tokens", 0),
                                 model=data.get("model", self.name),
                                 reasoning=msg.get("reasoning_content") or "", finish_reason=finish)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ModelError(f"{self.name}: malformed reply ({e}): {r.text[:500]}") from e


# ---- fitting a conversation to a token budget ----------------------------------------------------
def fit_messages(messages: list[dict], budget: int, keep_turns: int = 4, clear_thinking: bool = True,
                 chars_per_token: float = CHARS_PER_TOKEN) -> list[dict]:
    """The conversation within `budget` tokens (estimated), in OpenAI order; see the module docstring."""
    budget_chars = int(budget * chars_per_token) - 100  # room for the "turns dropped" note
    msgs = _ordered([dict(m) for m in messages])
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(msgs):
        if clear_thinking and i < last_user:
            m.pop("reasoning_content", None)
    head = [m for m in msgs[:2] if m.get("role") in ("system", "user")]  # system prompt + objective
    turns = _turns(msgs[len(head):])
    recent = max(0, len(turns) - keep_turns)
    for turn in turns[:recent]:  # older observations first
        for m in turn:
            if m.get("role") in ("tool", "user"):
                m["content"] = _truncate(m.get("content"))
    dropped = 0
    while len(turns) > keep_turns and _chars(head + _flat(turns)) > budget_chars:
        turns.pop(0)  # the oldest whole turn goes
        dropped += 1
    if _chars(head + _flat(turns)) > budget_chars:  # the latest turns themselves are too big: cut their outputs
        for m in _flat(turns):
            if m.get("role") in ("tool", "user"):
                m["content"] = _truncate(m.get("content"), keep=max(200, budget_chars // (4 * len(turns))))
    while len(turns) > 1 and _chars(head + _flat(turns)) > budget_chars:
        turns.pop(0)  # last resort: fewer recent turns
        dropped += 1
    note = ([{"role": "user", "content": f"[{dropped} earlier turn(s) dropped to fit the context window]"}]
            if dropped else [])
    return head + note + _flat(turns)


def _ordered(msgs: list[dict]) -> list[dict]:
    """Every assistant tool call answered by its tool message right after it (user text moved after)."""
    out, i = [], 0
    while i < len(msgs):
        m = msgs[i]
        out.append(m)
        i += 1
        ids = [c.get("id") for c in m.get("tool_calls") or []] if m.get("role") == "assistant" else []
        if not ids:
            continue
        replies, later = {}, []
        while i < len(msgs) and msgs[i].get("role") in ("tool", "user"):
            r = msgs[i]
            (replies.__setitem__(r.get("tool_call_id"), r) if r.get("role") == "tool" and
             r.get("tool_call_id") in ids else later.append(r))
            i += 1
        for cid in ids:
            out.append(replies.get(cid) or {"role": "tool", "tool_call_id": cid, "content": "[no result recorded]"})
        out.extend(m2 if m2.get("role") != "tool" else {"role": "user", "content": m2.get("content") or ""}
                   for m2 in later)
    return out


def _turns(msgs: list[dict]) -> list[list[dict]]:
    """Groups that start at a user or assistant message; an assistant's tool replies stay with it."""
    turns: list[list[dict]] = []
    for m in msgs:
        if m.get("role") == "tool" and turns:
            turns[-1].append(m)
        else:
            turns.append([m])
    return turns


def _flat(turns):
    return [m for t in turns for m in t]


def _truncate(content, keep: int = KEEP_CHARS):
    if not isinstance(content, str) or len(content) <= keep:
        return content
    half = keep // 2
    return f"{content[:half]}\n[... {len(content) - 2 * half} characters truncated ...]\n{content[-half:]}"


def _chars(msgs: list[dict]) -> int:
    """Size of messages as the estimate counts it (their JSON; role and framing included)."""
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in msgs)


def _args(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": raw}
