"""What the engine reports back: per-request outputs with per-choice text and tokens, and its load."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # while running: all but a tail that may still become a stop string (never taken back)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None

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


@dataclass
class EngineStats:
    """A snapshot of the engine's load and counters (the server's metrics read these)."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int  # free blocks still holding a prefix-cache entry
    prefix_hit_blocks: int  # prompt blocks served from the prefix cache (cumulative)
    prefix_query_blocks: int  # prompt blocks looked up (cumulative)
    preemptions: int
    steps: int
    prompt_tokens: int
    generation_tokens: int
    computed_tokens: int
    draft_tokens: int = 0  # MTP drafts verified (speculative decoding; cumulative)
    accepted_draft_tokens: int = 0  # of those, accepted
