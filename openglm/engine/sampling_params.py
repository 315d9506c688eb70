"""SamplingParams: what a request asks of the sampler (the OpenAI / vLLM parameter set).

The bounds below are the engine's own: any value inside them samples without NaN/inf or an
out-of-range seed, so one request's parameters can never fail a batch it shares with others. The
server's request models take their field limits from these constants (one set of numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TEMPERATURE_FLOOR = 1e-2  # below this logits/temperature overflow; 0 (greedy) is the way to ask for argmax
TEMPERATURE_MAX = 2.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # a divisor/multiplier of logits: outside this they under/overflow
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency (OpenAI's range)
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, what torch.Generator.manual_seed accepts (seed + choice index)
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_K = 1 << 20  # larger than any vocabulary: "keep everything"


class SamplingParamsError(ValueError):
    """A SamplingParams field is out of bounds; `field` names it (the server reports it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # v == v: not NaN


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
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # a set: looked up once per token
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top alternatives to return per token (0 = only the chosen one)
    grammar: str | None = None  # an llguidance grammar the output must match (engine/grammar.py)
    # the thinking budget (engine/thinking.py): reasoning tokens after which </think> is forced (None: no limit),
    # the (<think>, </think>) token ids, whether the prompt opened the reasoning (else the model may), and other
    # tokens that end it (<tool_call> where tools are listed: a model may skip </think> and go straight to a call)
    thinking_budget: int | None = None
    think_ids: tuple[int, int] | None = None
    thinking_open: bool = True
    think_end_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple, set, frozenset)) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError("stop_token_ids", f"SamplingParams.stop_token_ids takes at most "
                                                        f"{MAX_STOP_TOKEN_IDS} token ids")
        self.stop_token_ids = frozenset(ids)
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise SamplingParamsError(name, f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def in_range(name, lo, hi):
            v = getattr(self, name)
            if not _is_number(v) or not lo <= v <= hi:
                bad(name, f"must be a number in [{lo}, {hi}]")

        t = self.temperature
        if not _is_number(t) or not (t == 0 or TEMPERATURE_FLOOR <= t <= TEMPERATURE_MAX):
            bad("temperature", f"must be 0 (greedy) or in [{TEMPERATURE_FLOOR}, {TEMPERATURE_MAX}]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 0 < self.top_k <= MAX_TOP_K):
            bad("top_k", f"must be -1 (disabled) or in [1, {MAX_TOP_K}]")
        in_range("min_p", 0.0, 1.0)
        in_range("repetition_penalty", *REPETITION_PENALTY_RANGE)
        in_range("presence_penalty", *PENALTY_RANGE)
        in_range("frequency_penalty", *PENALTY_RANGE)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            bad("seed", f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be a positive integer")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be in [0, max_tokens]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS
                                                    for s in self.stop):
            bad("stop", f"takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                        f"{MAX_STOP_STRING_CHARS} characters")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        if self.thinking_budget is not None:
            if not _is_int(self.thinking_budget) or self.thinking_budget < 0:
                bad("thinking_budget", "must be a non-negative integer")
            ids = self.think_ids
            if not (isinstance(ids, tuple) and len(ids) == 2 and all(_is_int(t) and t >= 0 for t in ids)):
                bad("think_ids", "must be the (<think>, </think>) token ids when thinking_budget is set")
        if not (isinstance(self.think_end_ids, tuple) and all(_is_int(t) and t >= 0 for t in self.think_end_ids)):
            bad("think_end_ids", "must be a tuple of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
