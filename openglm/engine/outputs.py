"""What the engine reports back: per-request outputs with per-choice text, tokens and deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None
    delta_text: str = ""  # new since the previous report (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival, first token and finish times (monotonic seconds)
    error: str | None = None  # set when a step failed for this request alone (it finished with "error")
