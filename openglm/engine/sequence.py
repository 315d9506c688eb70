"""A Sequence: one generation stream (a request with n=2 owns two), its tokens and its KV blocks."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from openglm.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str = "", index: int = 0,
                 group: str | None = None):
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(_ids)
        self.request_id = request_id or f"seq-{self.seq_id}"
        self.index = index  # which of the request's n choices
        self.group = group or self.request_id  # the client request it serves: the scheduler shares slots by group
        self.admitted = -1  # when the scheduler last admitted it (an ordinal)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)  # shared by every output: never changed
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV entries are in the cache
        self.num_cached_prompt_tokens = 0  # of those, how many came from the prefix cache at admission
        self.block_table: list[int] = []
        self.state_slot: int | None = None  # hybrid models: the slot of its linear-attention state (state_cache.py)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict] = []  # per output token: {"token_id", "logprob", "top": [(id, lp), ...]}
        self.output_text = ""  # detokenized output so far (complete characters), truncated at a stop string
        # incremental detokenization: output tokens [decoded_from, decoded_upto) were decoded last time (the context
        # of the next decode), those after decoded_upto are not in output_text yet
        self.decoded_from = self.decoded_upto = 0
        self.reported_chars = self.reported_tokens = 0  # what the outputs so far carried
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.generator = None  # torch.Generator when params.seed is set (made by the sampler)
        self.matcher = None  # llguidance matcher when params.grammar is set (made by the engine)
        self.reasoning = None  # where its reasoning stands, with a thinking budget (engine/thinking.py)
        # speculative decoding: tokens the MTP layer proposed after token_ids, verified in the next step,
        # and (sampling) the distributions they were drawn from, [len(drafts), vocab]
        self.draft_token_ids: list[int] = []
        self.draft_probs = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the KV blocks; prompt + output so far are prefilled again later."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.set_drafts([], None)

    def set_drafts(self, token_ids: list[int], probs=None) -> None:
        self.draft_token_ids = list(token_ids)
        self.draft_probs = probs[: len(token_ids)] if probs is not None and token_ids else None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, status={self.status.name})")
