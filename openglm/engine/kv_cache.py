"""The paged KV pool and the per-step view of it that the model sees.

`KVPool` holds, for every layer and entry name (for MLA: `kv` latent, `k_pe` roped key, `index_k`
DSA indexer key), one flat tensor of `num_blocks * block_size` slots; slot = block * block_size + offset.
Pools are created on the first write, so any model that speaks the cache protocol works.

`PagedBatchCache` implements the model's cache protocol (`get_seq_length`, `update`) for one step:
new entries are scattered into their slots, and the batch's past entries are gathered from the
block tables into a padded `[B, P + T, ...]` tensor. Layout per row: past right-aligned in the first
P columns (left padding), new tokens left-aligned in the last T columns (right padding); the step's
attention mask marks the real columns.
"""

from __future__ import annotations

import torch

from openglm.model.cache import DecodeRows, KeyShadow


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32, device=None):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.device = torch.device(device or "cpu")
        self.num_slots = num_blocks * block_size
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}
        self.shadows: dict[int, KeyShadow] = {}  # layer -> the int8 shadow of its `index_k` (decode's scan reads it)

    def tensor(self, layer: int, name: str, like: torch.Tensor) -> torch.Tensor:
        key = (layer, name)
        pool = self.tensors.get(key)
        if pool is None:
            # one extra all-zero slot at the end: padding positions gather from it
            pool = torch.zeros((self.num_slots + 1, *like.shape[2:]), dtype=self.dtype, device=self.device)
            self.tensors[key] = pool
            if name == "index_k" and (shadow := KeyShadow.for_keys(self.num_slots + 1, pool.shape[1], self.device)):
                self.shadows[layer] = shadow
        elif pool.shape[1:] != like.shape[2:]:
            raise ValueError(f"cache entry {name!r} of layer {layer} has shape {tuple(like.shape[2:])}, "
                             f"the pool holds {tuple(pool.shape[1:])}")
        return pool

    @property
    def pad_slot(self) -> int:
        return self.num_slots

    def bytes_per_token(self) -> int:
        shadows = sum(t.bytes_per_slot for t in self.shadows.values())
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values()) + shadows

    def write(self, layer: int, name: str, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """values [n, ...] into slots [n] of the layer's `name` pool (and of its key shadow for `index_k`); returns
        the pool."""
        pool = self.tensor(layer, name, values[None])
        pool[slots] = values.to(pool.dtype)
        if name == "index_k" and layer in self.shadows:
            self.shadows[layer].write(slots, pool[slots])
        return pool


class PagedBatchCache:
    def __init__(self, pool: KVPool, block_tables: list[list[int]], past_lens: list[int], new_lens: list[int]):
        self.pool = pool
        self.batch, self.past, self.new = len(past_lens), max(past_lens), max(new_lens)
        self.lens = (past_lens, new_lens)
        bs = pool.block_size
        # the slot of every cached-or-new position of each sequence, in order
        self.seq_slots = [(torch.tensor(table, dtype=torch.long)[:, None] * bs + torch.arange(bs)).flatten()[: p + t]
                          for table, p, t in zip(block_tables, past_lens, new_lens)]
        self._gather = None  # `update`'s index tensors, built on its first call (a native decode step needs none)

    def _gather_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(read_index, write_slots, write_rows): the slot of each position as the model sees the step, [pad .. past |
        new .. pad] per row with padding reading the all-zero slot; the slots of the new entries; which rows of the
        flattened [B * T] new entries are real."""
        if self._gather is None:
            past_lens, new_lens = self.lens
            read = torch.full((self.batch, self.past + self.new), self.pool.pad_slot, dtype=torch.long)
            for row, (slots, p, t) in enumerate(zip(self.seq_slots, past_lens, new_lens)):
                read[row, self.past - p : self.past + t] = slots
            write = torch.cat([slots[p:] for slots, p in zip(self.seq_slots, past_lens)])
            valid_new = torch.arange(self.new)[None, :] < torch.tensor(new_lens)[:, None]
            to = self.pool.device  # built on the CPU, used where the pool is
            self._gather = read.flatten().to(to), write.to(to), valid_new.flatten().nonzero().squeeze(1).to(to)
        return self._gather

    def get_seq_length(self) -> int:
        return self.past

    def decode_layout(self, batch: int, new: int, attention_mask) -> "PagedBatchCache | None":
        """This step as `decode_step` reads it (the pool's slots through the block tables, no gather), when every
        row has `new` tokens (else None: the torch path pads them); the attention mask is the step's own."""
        past_lens, new_lens = self.lens
        if (batch != self.batch or any(t != new for t in new_lens)
                or any(len(s) != p + new for s, p in zip(self.seq_slots, past_lens))):
            return None  # (a block table too short for its positions: the torch path's gather names it)
        self.max_keys = max(past_lens) + new
        self.keys = [p + t + 1 for p in past_lens for t in range(new)]
        starts = [0]
        for slots in self.seq_slots[:-1]:
            starts.append(starts[-1] + len(slots))
        self.decode_rows = (torch.cat(self.seq_slots), torch.tensor([s for s in starts for _ in range(new)]),
                            torch.tensor(self.keys), torch.cat([s[p:] for s, p in zip(self.seq_slots, past_lens)]))
        return self

    def keys_of(self, row: int) -> int:
        return self.keys[row]

    def rows(self, layer_idx: int, specs: dict[str, tuple[int, torch.dtype]]) -> DecodeRows:
        """Layer `layer_idx`'s pools (created from `specs`, name -> (width, dtype), on a first step) and the step's
        slots; the native call writes the new entries in the pool's dtype."""
        entries = {name: self.pool.tensor(layer_idx, name, torch.empty(1, 1, width))
                   for name, (width, _) in specs.items()}
        return DecodeRows(entries, *self.decode_rows, self.pool.shadows.get(layer_idx))

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Write the new entries into their slots, then read past + new back in one gather."""
        full = {}
        read_index, write_slots, write_rows = self._gather_plan()
        for name, new in entries.items():
            flat = new.reshape(self.batch * self.new, *new.shape[2:])
            pool = self.pool.write(layer_idx, name, write_slots, flat[write_rows])
            if self.past:
                full[name] = pool[read_index].view(self.batch, self.past + self.new, *new.shape[2:]).to(new.dtype)
            else:
                full[name] = new
        return full
