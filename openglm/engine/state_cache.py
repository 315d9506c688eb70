"""Per-sequence recurrent state beside the paged KV pool, for hybrid models (glm5_next's KDA layers).

A linear-attention layer keeps no per-token entries: a sequence's whole past is one fixed-size state per layer
(`LinearState`: the delta rule's [H, d, d] fp32 matrix and the conv window). The engine gives every running
sequence a state slot (`StateSlots`, the scheduler's accounting, like the block manager's for KV blocks); the
runner's `StatePool` holds the tensors, and `HybridBatchCache` is the paged cache plus the model's state protocol
(`linear_state` / `set_linear_state` / `advance`) for one step.

Each slot has two rows, tagged with the (sequence, tokens covered) of the state they hold. A step over tokens
[p, p + n) reads the row tagged p (nothing when p = 0: a fresh sequence starts from zeros) and writes the other
one, tagged p + n once the forward is done. A step that fails part-way, or whose sampling fails, can so be run
again as it was: the state it started from is untouched (the paged KV entries are rewritten in place alike).

Preemption frees the slot; on resume the sequence is recomputed from its first token (a state cannot be rebuilt
from a prefix of the latent cache). For the same reason prefix caching is off for these models: a cached block
would need a state snapshot at its boundary.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from openglm.engine.config import EngineConfig
from openglm.engine.kv_cache import KVPool, PagedBatchCache

log = logging.getLogger("openglm.engine")


def linear_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{layer index: attention module} of the model's layers that keep a recurrent state (`kind` "linear")."""
    layers = getattr(getattr(model, "model", None), "layers", [])
    return {i: layer.self_attn for i, layer in enumerate(layers) if getattr(layer.self_attn, "kind", "") == "linear"}


def hybrid_engine_config(model: torch.nn.Module, config: EngineConfig) -> tuple[EngineConfig, list[str]]:
    """The engine settings a model with linear-attention layers runs under, and the notes saying what changed
    (also logged). A model without such layers gets `config` unchanged and no notes."""
    if not linear_layers(model):
        return config, []
    kind = getattr(model.config, "model_type", "hybrid")
    if config.num_speculative_tokens:
        raise ValueError(f"num_speculative_tokens: MTP drafts are not supported for {kind} models (their next-n "
                         "layer does not draft from the engine's cache yet); use 0")
    notes = []
    if config.enable_prefix_caching:
        config = replace(config, enable_prefix_caching=False)
        notes.append(f"prefix caching is off for {kind}: its linear-attention layers would need a state snapshot "
                     "at every cached block boundary, which this engine does not keep")
    notes.append(f"{kind} decode steps run the torch reference path (no native decode step for its linear-attention "
                 "and pooled-DSA layers yet)")
    for note in notes:
        log.info(note)
    return config, notes


class StateSlots:
    """Which state slots are free: one per running sequence (`seq.state_slot`), returned at finish, abort and
    preemption."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq) -> None:
        assert seq.state_slot is None, f"{seq} already holds state slot {seq.state_slot}"
        if not self.free_slots:
            raise RuntimeError(f"no free state slot ({self.num_slots} in use)")
        seq.state_slot = self.free_slots.pop()

    def free(self, seq) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None


class StatePool:
    """The state rows of every linear-attention layer: layer -> `LinearState` with 2 rows per slot (row 2s + r),
    and each row's tag (sequence id, tokens its state covers). Rows are allocated as slots are first used (slots
    are handed out lowest first), so the pool grows with the sequences running at once, up to `num_slots`."""

    def __init__(self, layers: dict[int, torch.nn.Module], num_slots: int, dtype: torch.dtype, device):
        self.layers, self.num_slots, self.dtype, self.device = layers, num_slots, dtype, device
        self.states = {i: attn.empty_state(0, dtype, device) for i, attn in layers.items()}
        self.tags: list[tuple[int, int] | None] = []

    @property
    def capacity(self) -> int:
        """Slots allocated so far."""
        return len(self.tags) // 2

    def _grow(self, slot: int) -> None:
        """Room for `slot`: the capacity doubled (at least), up to num_slots; rows kept, new ones zero."""
        if slot >= self.num_slots:
            raise ValueError(f"state slot {slot} out of range (the pool has {self.num_slots})")
        cap = min(self.num_slots, max(slot + 1, 2 * self.capacity))
        for i, attn in self.layers.items():
            old, new = self.states[i], attn.empty_state(2 * cap, self.dtype, self.device)
            new.recurrent[: old.recurrent.shape[0]] = old.recurrent
            new.conv[: old.conv.shape[0]] = old.conv
            self.states[i] = new
        self.tags += [None] * (2 * cap - len(self.tags))

    def plan(self, rows: list[tuple[int, int]], past_lens: list[int], new_lens: list[int]):
        """For a step's rows [(slot, seq id)]: (the pool row each reads, -1 = a fresh sequence; the row each
        writes; the tags the written rows get)."""
        read, write, tags = [], [], []
        for (slot, seq_id), p, t in zip(rows, past_lens, new_lens):
            if slot >= self.capacity:
                self._grow(slot)
            pair = (2 * slot, 2 * slot + 1)
            if p == 0:  # a sequence (re)starting in this slot: what the rows held is no one's any more
                self.tags[pair[0]] = self.tags[pair[1]] = None
            mine = [r for r in pair if self.tags[r] == (seq_id, p)]
            if p and not mine:
                raise RuntimeError(f"sequence {seq_id}: no linear-attention state for its first {p} tokens in slot "
                                   f"{slot}")
            src = mine[0] if p else -1
            write.append(pair[1] if src == pair[0] else pair[0])
            read.append(src)
            tags.append((seq_id, p + t))
        return read, write, tags

    def read(self, layer: int, rows: list[int]):
        """The layer's `LinearState` for the step's rows (zeros where a row is -1), or None when all are fresh."""
        if all(r < 0 for r in rows):
            return None
        index = torch.tensor([max(r, 0) for r in rows], device=self.device)
        state = self.states[layer].select(index)
        fresh = torch.tensor([r < 0 for r in rows], device=self.device)
        if fresh.any():
            state.recurrent[fresh] = 0
            state.conv[fresh] = 0
        return state

    def write(self, layer: int, rows: list[int], state) -> None:
        pool = self.states[layer]
        index = torch.tensor(rows, device=self.device)
        pool.recurrent.index_copy_(0, index, state.recurrent.to(pool.recurrent.dtype))
        pool.conv.index_copy_(0, index, state.conv.to(pool.conv.dtype))

    def tag(self, rows: list[int], tags: list[tuple[int, int]]) -> None:
        for r, t in zip(rows, tags):
            self.tags[r] = t


class HybridBatchCache(PagedBatchCache):
    """One step's cache for a hybrid model: the paged latents (`PagedBatchCache`) and the rows' KDA states."""

    def __init__(self, pool: KVPool, states: StatePool, block_tables, past_lens, new_lens, state_rows):
        super().__init__(pool, block_tables, past_lens, new_lens)
        self.states = states
        self.read_rows, self.write_rows, self.tags = states.plan(state_rows, past_lens, new_lens)

    def linear_state(self, layer_idx: int):
        return self.states.read(layer_idx, self.read_rows)

    def set_linear_state(self, layer_idx: int, state) -> None:
        self.states.write(layer_idx, self.write_rows, state)

    def advance(self, n: int) -> None:
        """The forward is done: the rows it wrote now hold the sequences' states."""
        self.states.tag(self.write_rows, self.tags)

    def decode_layout(self, batch: int, new: int, attention_mask) -> None:
        return None  # no native decode step for these layers
