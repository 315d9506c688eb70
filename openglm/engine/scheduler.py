"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Every step has a token budget (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`).
Running sequences go first (one token each when decoding, plus its draft tokens under speculative
decoding, or a chunk when their prompt is still being prefilled); waiting requests join with whatever
budget is left, their long prompts cut into chunks (chunked prefill). When the KV pool runs dry, the most
recently admitted sequence is preempted: its blocks (and a hybrid model's state slot) are freed and it is
recomputed later, instead of any request failing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from openglm.engine.block_manager import BlockManager
from openglm.engine.config import EngineConfig
from openglm.engine.sequence import Sequence, SequenceStatus
from openglm.engine.state_cache import StateSlots


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens each sequence computes in this step

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, state_slots: StateSlots | None = None):
        self.config = config
        self.block_manager = block_manager
        self.state_slots = state_slots  # hybrid models: a running sequence also holds a state slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        max_blocks = self.block_manager.num_blocks
        if self.block_manager.blocks_needed(seq.num_prompt_tokens + 1) > max_blocks:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens cannot fit in the KV pool "
                             f"({max_blocks} blocks of {self.block_manager.block_size})")
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        self.block_manager.expire()
        budget = self.config.max_num_batched_tokens
        seqs, counts = [], []
        preempted = False

        # 1. running sequences: decode one token, or continue a chunked prefill
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            drafts = seq.draft_token_ids if seq.num_uncomputed_tokens == 1 else []
            n = min(seq.num_uncomputed_tokens + len(drafts), budget)
            if drafts:  # speculative decoding: verify the drafts that fit the budget in this step
                seq.set_drafts(drafts[: n - 1], seq.draft_probs)
            while not self.block_manager.can_append(seq, n):
                victim = queue.pop() if queue else seq  # newest first; ourselves last
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq, n)
                seqs.append(seq)
                counts.append(n)
                budget -= n

        # 2. admit waiting requests (not in a step that had to preempt: there is no room)
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            no_slot = self.state_slots is not None and not self.state_slots.num_free
            if no_slot or not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._free_state(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark done and return the blocks to the pool (their full blocks stay in the prefix cache)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free(seq)
        self._free_state(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def _free_state(self, seq: Sequence) -> None:
        if self.state_slots is not None:
            self.state_slots.free(seq)
