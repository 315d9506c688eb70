"""KV cache protocol and the default contiguous implementation.

The model touches a cache only through `get_seq_length()` and `update(layer_idx, entries)`, so
the inference engine's paged cache can stand in for `DynamicCache`. MLA layers cache the normed
compressed latent `kv` [B,T,kv_lora_rank] and the roped key `k_pe` [B,T,qk_rope_head_dim]
(never the expanded per-head keys/values); layers with their own DSA indexer also cache `index_k`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class KVCache(Protocol):
    def get_seq_length(self) -> int: ...

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


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
            bufs = self._buffers[layer_idx] = [_LayerBuffer(group) for group in _by_dtype(entries)]
        held = [name for buf in bufs for name in buf.names]
        if set(held) != set(entries):
            raise KeyError(f"layer {layer_idx}: cache holds {sorted(held)}, update gave {sorted(entries)}")
        out = {}
        for buf in bufs:
            buf.append(entries)
            out.update(buf.views())
        return {name: out[name] for name in entries}

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
