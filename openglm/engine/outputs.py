"""What the engine reports back: per-request outputs with per-choice text and tokens, and its load."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One choice. While it runs an output carries only what is new since its previous output (`delta_*`), so
    that reporting a step costs what the step added, not what the choice holds; once finished, `text`,
    `token_ids` and `logprobs` hold the whole output as well (None before)."""

    index: int
    text: str | None  # finished: the whole text (cut at a stop string); running: None
    token_ids: list[int] | None  # finished: every output token; running: None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None  # finished: one per output token, when the request asked for them
    delta_text: str = ""  # text new since the previous output (never taken back: a possible stop string waits)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict] | None = None  # one per delta token, when the request asked for logprobs
    text_offset: int = 0  # characters of text reported before delta_text

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
