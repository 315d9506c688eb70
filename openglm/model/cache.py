"""KV cache protocol and the default contiguous implementation.

The model touches a cache only through `get_seq_length()` and `update(layer_idx, entries)`, so
the inference engine's paged cache can stand in for `DynamicCache`. MLA layers cache the normed
compressed latent `kv` [B,T,kv_lora_rank] and the roped key `k_pe` [B,T,qk_rope_head_dim]
(never the expanded per-head keys/values); layers with their own DSA indexer also cache `index_k`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    def get_seq_length(self) -> int: ...

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class DynamicCache:
    """Grows by concatenation along the sequence dim; one dict of tensors per layer."""

    def __init__(self):
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def get_seq_length(self) -> int:
        if not self.layers:
            return 0
        first = self.layers[min(self.layers)]
        return next(iter(first.values())).shape[1]

    def update(self, layer_idx: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        old = self.layers.get(layer_idx)
        if old is None:
            new = {k: v.contiguous() for k, v in entries.items()}
        else:
            if set(old) != set(entries):
                raise KeyError(f"layer {layer_idx}: cache holds {sorted(old)}, update gave {sorted(entries)}")
            new = {k: torch.cat([old[k], v], dim=1) for k, v in entries.items()}
        self.layers[layer_idx] = new
        return new

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam search, dropping finished sequences)."""
        for layer in self.layers.values():
            for k in layer:
                layer[k] = layer[k].index_select(0, index)
