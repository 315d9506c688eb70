"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

Every step has a token budget (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`).
Running sequences go first (one token each when decoding, plus its draft tokens under speculative
decoding, or a chunk when their prompt is still being prefilled); waiting requests join with whatever
budget is left, their long prompts cut into chunks (chunked prefill). When the KV pool runs dry, the most recently
admitted sequence (of the request holding the most) is preempted: its blocks (and a hybrid model's state slot) are
freed and it is recomputed later, instead of any request failing.

Requests share the batch fairly. A sequence belongs to a *group*, the client request it serves (a server request
with many prompts and `n` choices is one group; by default a group is one engine request). Waiting sequences are
admitted from the group with the fewest running sequences first, running ones are ordered round-robin across
groups (the first group turning each step), and while a group with fewer than `max_seqs_per_request` running
sequences waits for room that others hold, the group running the most beyond that share gives up its newest
sequence. So one request of 256 prompts x n=16 cannot starve a 4-token chat; alone, a request still uses every
slot. The waiting sequences are kept per group and a finished (aborted) one is dropped lazily, so admission and
abort cost does not grow with the size of one request.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
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
        self.queues: dict[str, deque[Sequence]] = {}  # group -> its waiting sequences (groups in arrival order)
        self.num_waiting = 0
        self.running: list[Sequence] = []
        self.running_per_group: Counter = Counter()
        self.num_preemptions = 0
        self._turn = 0  # which group goes first this step
        self._admissions = itertools.count()

    def add(self, seq: Sequence) -> None:
        max_blocks = self.block_manager.num_blocks
        if self.block_manager.blocks_needed(seq.num_prompt_tokens + 1) > max_blocks:
            raise ValueError(f"prompt of {seq.num_prompt_tokens} tokens cannot fit in the KV pool "
                             f"({max_blocks} blocks of {self.block_manager.block_size})")
        self.queues.setdefault(seq.group, deque()).append(seq)
        self.num_waiting += 1

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences, group by group (a snapshot)."""
        return [s for q in self.queues.values() for s in q if s.status == SequenceStatus.WAITING]

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + len(self.running)

    def schedule(self) -> ScheduledBatch:
        self.block_manager.expire()
        self._share_room()
        budget = self.config.max_num_batched_tokens
        seqs, counts = [], []
        preempted = False

        # 1. running sequences: decode one token, or continue a chunked prefill
        queue = self._round_robin(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            drafts = seq.draft_token_ids if seq.num_uncomputed_tokens == 1 else []
            n = min(seq.num_uncomputed_tokens + len(drafts), budget)
            if drafts:  # speculative decoding: verify the drafts that fit the budget in this step
                seq.set_drafts(drafts[: n - 1], seq.draft_probs)
            while not self.block_manager.can_append(seq, n):
                victim = self._victim(queue) if queue else seq  # ourselves last
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq, n)
                seqs.append(seq)
                counts.append(n)
                budget -= n

        # 2. admit waiting requests, fewest running first (not in a step that had to preempt: there is no room)
        while self.num_waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self._next_waiting()
            if not self._has_state_slot() or not self.block_manager.can_allocate(seq):
                break
            self._pop_waiting(seq)
            self.block_manager.allocate(seq)
            if self.state_slots is not None:
                self.state_slots.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.admitted = next(self._admissions)
            self.running.append(seq)
            self.running_per_group[seq.group] += 1
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    # ---- fairness -------------------------------------------------------------------------------
    def _round_robin(self, seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` interleaved across groups: every group's first, then every group's second, ...; the group that
        goes first turns each step, so that a short token budget is not always spent on the same request."""
        groups: dict[str, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(s.group, []).append(s)
        if len(groups) in (1, len(seqs)):  # one request, or one sequence each: nothing to share out
            return list(seqs)
        order = list(groups.values())
        self._turn = (self._turn + 1) % len(order)
        order = order[self._turn:] + order[: self._turn]
        return [g[i] for i in range(max(map(len, order))) for g in order if i < len(g)]

    def _next_waiting(self) -> Sequence:
        """The next sequence to admit: the first waiting one of the group with the fewest running."""
        group = min(self._waiting_groups(), key=lambda g: self.running_per_group[g])
        return self._head(group)

    def _share_room(self) -> None:
        """A group under its share that cannot be admitted (no slot, or no KV room) takes a sequence from the group
        running the most beyond its share, one per step."""
        share = self.config.max_seqs_per_request
        starved = next((g for g in self._waiting_groups() if self.running_per_group[g] < share), None)
        if starved is None:
            return
        if (len(self.running) < self.config.max_num_seqs and self._has_state_slot()
                and self.block_manager.can_allocate(self._head(starved))):
            return
        hog, held = max(self.running_per_group.items(), key=lambda kv: kv[1], default=(None, 0))
        if held > share:
            self._preempt(max((s for s in self.running if s.group == hog), key=lambda s: s.admitted))

    def _victim(self, queue: list[Sequence]) -> Sequence:
        """The sequence to preempt among those not yet scheduled this step: the newest of the group running the
        most (with one sequence per group: simply the newest)."""
        victim = max(queue, key=lambda s: (self.running_per_group[s.group], s.admitted))
        queue.remove(victim)
        return victim

    # ---- the waiting queues ---------------------------------------------------------------------
    def _waiting_groups(self):
        return (g for g, q in self.queues.items() if q)

    def _head(self, group: str) -> Sequence:
        """The group's first waiting sequence (finished ones, i.e. aborted while waiting, are dropped here)."""
        q = self.queues[group]
        while q[0].status != SequenceStatus.WAITING:
            q.popleft()
        return q[0]

    def _pop_waiting(self, seq: Sequence) -> None:
        q = self.queues[seq.group]
        q.popleft()
        self.num_waiting -= 1
        self._forget_group(seq.group)

    def _forget_group(self, group: str) -> None:
        q = self.queues.get(group)
        while q and q[0].status != SequenceStatus.WAITING:
            q.popleft()
        if q is not None and not q:
            del self.queues[group]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.running_per_group[seq.group] -= 1
        if not self.running_per_group[seq.group]:
            del self.running_per_group[seq.group]
        self.block_manager.free(seq)
        self._free_state(seq)
        seq.reset_for_recompute()
        self.queues.setdefault(seq.group, deque()).appendleft(seq)
        self.num_waiting += 1
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark done and return the blocks to the pool (their full blocks stay in the prefix cache)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.running_per_group[seq.group] -= 1
            if not self.running_per_group[seq.group]:
                del self.running_per_group[seq.group]
        elif seq.status == SequenceStatus.WAITING:
            self.num_waiting -= 1  # left in its group's queue, dropped when it reaches the front
        if seq.block_table:
            self.block_manager.free(seq)
        self._free_state(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self._forget_group(seq.group)

    def _has_state_slot(self) -> bool:
        """Whether a sequence admitted now gets a state slot (hybrid models; others need none)."""
        return self.state_slots is None or self.state_slots.num_free > 0

    def _free_state(self, seq: Sequence) -> None:
        if self.state_slots is not None:
            self.state_slots.free(seq)
