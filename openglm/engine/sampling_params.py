"""SamplingParams: what a request asks of the sampler (the OpenAI / vLLM parameter set)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, on prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI-style, on output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top alternatives to return per token (0 = only the chosen one)
    grammar: str | None = None  # an llguidance grammar the output must match (engine/grammar.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive integer")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be a positive integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
