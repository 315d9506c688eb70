"""KV cache protocol and the default contiguous implementation.

The model touches a cache only through `get_seq_length()` and `update(layer_idx, entries)`, so
the inference engine's paged cache can stand in for `DynamicCache`. MLA layers cache the normed
compressed latent `kv` [B,T,kv_lora_rank] and the roped key `k_pe` [B,T,qk_rope_head_dim]
(never the expanded per-head keys/values); layers with their own DSA indexer also cache `index_k`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


class KVCache(Protocol):
    def get_seq_length(self) -> int: ...

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    # Optional: `decode_layout(batch, new, attention_mask)` -> an object with `rows(layer_idx, specs)` -> DecodeRows,
    # `max_keys` and `keys_of(row)`, or None; `model/decode_step.py` then runs a decode step's layers natively.


@dataclass
class DecodeRows:
    """Where one layer's cache holds a decode step's keys, for `decode_step`'s native calls. Each entry is a 2-D
    tensor whose row s is slot s. Row r (the step's new tokens, flattened [batch * new]) sees row_keys[r] keys, its
    own included; key i is slot table[row_base[r] + i] (no table: slot row_base[r] + i), and its new entries go
    to slot write[r]. Index tensors are int64."""
    entries: dict[str, torch.Tensor]
    table: torch.Tensor | None
    row_base: torch.Tensor
    row_keys: torch.Tensor
    write: torch.Tensor
    shadow: "KeyShadow | None" = None  # the int8 shadow of `index_k`, slot for slot


class KeyShadow:
    """An int8 copy of the DSA indexer keys that a native decode step scans instead of the keys themselves (id + 4
    bytes a key against fp32's 4 id): slot t holds codes round(k_t * 127 / max|k_t|), laid out for AVX512-VNNI as
    [slots / 16, width / 4, 16 slots, 4 bytes], and the scale max|k_t| / 127. The scan bounds every key's score from
    it and scores exactly only the keys that could be in the top-k (decode_kernels.c, `shadow_top_slots`), so the
    selection is the exact one. `for_keys` gives None for a width that is not a multiple of 4 (no shadow: the scan
    reads the keys)."""

    def __init__(self, slots: int, width: int):
        slots = -(-slots // 16) * 16
        self.codes = torch.zeros(slots // 16, width // 4, 16, 4, dtype=torch.int8)
        self.scale = torch.zeros(slots)

    @classmethod
    def for_keys(cls, slots: int, width: int, device: torch.device | str = "cpu") -> "KeyShadow | None":
        # Only the CPU's native decode step reads a shadow: keys on another device (CUDA) keep none.
        return cls(slots, width) if width % 4 == 0 and torch.device(device).type == "cpu" else None

    @property
    def bytes_per_slot(self) -> int:
        return self.codes[0].numel() // 16 + self.scale.element_size()

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [n, width] (any float dtype) at slots [n]."""
        k = keys.float()
        amax = k.abs().amax(-1)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = (k * inv[:, None]).round_().to(torch.int8)
        self.codes[slots // 16, :, slots % 16] = codes.view(len(slots), self.codes.shape[1], 4)
        self.scale[slots] = amax / 127.0


CAPACITY_STEP = 256  # buffers are sized in multiples of this many positions (decode rarely reallocates)


class _LayerBuffer:
    """One layer's entries side by side in a single preallocated [B, capacity, sum of widths] tensor.

    A decode step then writes its one new position in place instead of re-concatenating the whole
    cache, and the returned entries are views, so adjacent entries (MLA's `kv` then `k_pe`) form
    one zero-copy key tensor (see `attention.latent_keys`)."""

    def __init__(self, entries: dict[str, torch.Tensor]):
        first = next(iter(entries.values()))
        self.batch = first.shape[0]
        self.names = list(entries)
        self.shapes = {k: tuple(v.shape[2:]) for k, v in entries.items()}
        self.widths = [math.prod(self.shapes[k]) for k in self.names]
        self.length = 0
        self.data = first.new_empty(self.batch, 0, sum(self.widths))

    def append(self, entries: dict[str, torch.Tensor]) -> None:
        T = next(iter(entries.values())).shape[1]
        for name in self.names:
            new = entries[name]
            if new.shape[0] != self.batch or tuple(new.shape[2:]) != self.shapes[name] or new.shape[1] != T:
                raise ValueError(f"cache entry {name!r}: got shape {tuple(new.shape)}, expected "
                                 f"[{self.batch}, {T}, {', '.join(map(str, self.shapes[name]))}]")
        self._reserve(self.length + T)
        # One row-block write per step (a decode step is bound by op count, not bytes).
        rows = [entries[name].reshape(self.batch, T, width) for name, width in zip(self.names, self.widths)]
        self.data[:, self.length:self.length + T] = torch.cat(rows, -1) if len(rows) > 1 else rows[0]
        self.length += T

    def _reserve(self, needed: int) -> None:
        if needed <= self.data.shape[1]:
            return
        # Geometric growth (amortised O(1) per token) by a quarter, not doubling: long contexts stay lean.
        capacity = max(needed, self.data.shape[1] * 5 // 4)
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        data = self.data.new_empty(self.batch, capacity, self.data.shape[2])
        data[:, :self.length] = self.data[:, :self.length]
        self.data = data

    def views(self) -> dict[str, torch.Tensor]:
        filled, out, col = self.data[:, :self.length], {}, 0
        for name, width in zip(self.names, self.widths):
            view = filled[..., col:col + width]
            out[name] = view if len(self.shapes[name]) == 1 else view.view(self.batch, self.length, *self.shapes[name])
            col += width
        return out

    def reorder(self, index: torch.Tensor) -> None:
        self.data = self.data[:, :self.length].index_select(0, index)
        self.batch = self.data.shape[0]


class _IndexKeyBuffer(_LayerBuffer):
    """`index_k`'s own buffer and its `KeyShadow` (slot b * capacity + i), rebuilt when the buffer is re-laid."""

    def __init__(self, entries: dict[str, torch.Tensor]):
        super().__init__(entries)
        self.shadow = KeyShadow.for_keys(0, self.widths[0], self.data.device)

    def append(self, entries: dict[str, torch.Tensor]) -> None:
        start = self.length
        super().append(entries)
        if self.shadow is not None:
            self.shadow.write(self._slots(start), entries["index_k"].reshape(-1, self.widths[0]))

    def _reserve(self, needed: int) -> None:
        capacity = self.data.shape[1]
        super()._reserve(needed)
        if self.data.shape[1] != capacity:
            self._rebuild()

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self._rebuild()

    def _rebuild(self) -> None:
        capacity = self.data.shape[1]
        self.shadow = KeyShadow.for_keys(self.batch * capacity, self.widths[0], self.data.device)
        if self.shadow is not None:
            self.shadow.write(self._slots(0), self.data[:, : self.length].reshape(-1, self.widths[0]))

    def _slots(self, start: int) -> torch.Tensor:
        """The slots of positions start .. length - 1 of every sequence, sequence-major."""
        return (torch.arange(self.batch)[:, None] * self.data.shape[1] + torch.arange(start, self.length)).flatten()


def _buffer(entries: dict[str, torch.Tensor]) -> _LayerBuffer:
    return _IndexKeyBuffer(entries) if list(entries) == ["index_k"] else _LayerBuffer(entries)


class DynamicCache:
    """Preallocated per-layer buffers, grown geometrically (by a quarter); `update` writes new positions
    in place and returns views of the filled part. `layers[i]` gives layer i's entries as a dict of views."""

    def __init__(self):
        self._buffers: dict[int, list[_LayerBuffer]] = {}

    @property
    def layers(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: {k: v for buf in bufs for k, v in buf.views().items()} for i, bufs in self._buffers.items()}

    def get_seq_length(self) -> int:
        if not self._buffers:
            return 0
        return self._buffers[min(self._buffers)][0].length

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not entries:
            raise ValueError(f"layer {layer_idx}: update needs at least one entry")
        bufs = self._buffers.get(layer_idx)
        if bufs is None:
            bufs = self._buffers[layer_idx] = [_buffer(group) for group in _by_dtype(entries)]
        held = [name for buf in bufs for name in buf.names]
        if set(held) != set(entries):
            raise KeyError(f"layer {layer_idx}: cache holds {sorted(held)}, update gave {sorted(entries)}")
        out = {}
        for buf in bufs:
            buf.append(entries)
            out.update(buf.views())
        return {name: out[name] for name in entries}

    def decode_layout(self, batch: int, new: int, attention_mask) -> "_ContiguousLayout | None":
        """The rows of a step of `new` tokens per sequence for `decode_step` (None with padding: the torch path
        masks it)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            return None
        return _ContiguousLayout(self, batch, new)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam search, dropping finished sequences)."""
        for bufs in self._buffers.values():
            for buf in bufs:
                buf.reorder(index)


OWN_BUFFER = {"index_k"}  # every decode step scans all of these rows, but gathers only some rows of the rest


def _by_dtype(entries: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Entries split into groups of one dtype and device (in order), one buffer each; an entry in
    OWN_BUFFER gets a buffer to itself, so neither the DSA indexer's scan of every `index_k` row nor
    attention's gather of selected `kv | k_pe` rows reads bytes it does not use."""
    groups: dict[tuple, dict[str, torch.Tensor]] = {}
    for name, t in entries.items():
        groups.setdefault((t.dtype, t.device, name if name in OWN_BUFFER else None), {})[name] = t
    return list(groups.values())


class _ContiguousLayout:
    """DynamicCache's rows for `decode_step`: sequence b's position i is slot b * capacity + i of each buffer."""

    def __init__(self, cache: DynamicCache, batch: int, new: int):
        self.cache, self.batch, self.new, self.past = cache, batch, new, cache.get_seq_length()
        self.max_keys = self.past + new
        self.row_keys = torch.arange(self.past + 1, self.past + new + 1).repeat(batch)
        self._bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # capacity -> (row_base, write)

    def keys_of(self, row: int) -> int:
        return self.past + row % self.new + 1

    def rows(self, layer_idx: int, specs: dict[str, tuple[int, torch.dtype]]) -> DecodeRows:
        """Reserve the step's positions in layer `layer_idx` (created from `specs`, name -> (width, dtype), on a first
        step) as `update` does, and say where they are; the native call writes them."""
        bufs = self.cache._buffers.get(layer_idx)
        if bufs is None:
            empty = {name: torch.empty(self.batch, 0, width, dtype=dtype) for name, (width, dtype) in specs.items()}
            bufs = self.cache._buffers[layer_idx] = [_buffer(group) for group in _by_dtype(empty)]
        entries = {}
        for buf in bufs:
            if buf.length != self.past or buf.batch != self.batch or any(name not in specs for name in buf.names):
                raise ValueError(f"layer {layer_idx}: the cache holds {buf.batch} x {buf.length} {buf.names}, the step "
                                 f"expects {self.batch} x {self.past} {list(specs)}")
            buf._reserve(self.past + self.new)
            flat, col = buf.data.view(-1, buf.data.shape[2]), 0
            for name, width in zip(buf.names, buf.widths):
                entries[name] = flat[:, col:col + width]
                col += width
            buf.length += self.new
        capacity = bufs[0].data.shape[1]
        if any(buf.data.shape[1] != capacity for buf in bufs):  # buffers of a layer grow together
            raise RuntimeError(f"layer {layer_idx}: cache buffers of unequal capacity")
        if capacity not in self._bases:
            base = torch.arange(self.batch).repeat_interleave(self.new) * capacity
            self._bases[capacity] = (base, base + self.row_keys - 1)
        base, write = self._bases[capacity]
        shadow = next((buf.shadow for buf in bufs if isinstance(buf, _IndexKeyBuffer)), None)
        return DecodeRows(entries, None, base, self.row_keys, write, shadow)
