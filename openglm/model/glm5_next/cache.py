"""The hybrid cache of a glm5_next model: per-sequence KDA state beside the DSA layers' cached entries.

Indexed-attention layers cache, per token, the normed latent `kv` (and a zero-width `k_pe`: no RoPE) and their
indexer's `index_k` / `index_gate` (`DynamicCache`'s buffers, which this extends). Linear-attention layers hold no
per-token entries: their whole past is a `LinearState` per layer (recurrent [B, H, d, d] fp32 + conv window
[B, 3 H d, K - 1]), replaced after every forward. The model reads and writes both through this object only:
    get_seq_length(), update(layer, entries)            as for every openglm cache (DSA layers)
    linear_state(layer) -> LinearState | None            the state before this forward (None: fresh sequences)
    set_linear_state(layer, state)                       the state after it
    advance(n)                                           called once per forward: n new tokens per sequence
An engine holds the same three things per sequence (a paged latent cache, one `LinearState` row per KDA layer) and
batches the rows of the sequences in a step with `LinearState.cat` / `select`.
"""

from __future__ import annotations

import torch

from openglm.model.cache import DynamicCache
from openglm.model.glm5_next.kda import LinearState


class HybridCache(DynamicCache):
    def __init__(self):
        super().__init__()
        self.states: dict[int, LinearState] = {}
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def advance(self, n: int) -> None:
        self.length += n

    def linear_state(self, layer_idx: int) -> LinearState | None:
        return self.states.get(layer_idx)

    def set_linear_state(self, layer_idx: int, state: LinearState) -> None:
        self.states[layer_idx] = state

    def decode_layout(self, batch: int, new: int, attention_mask) -> None:
        return None  # no native decode step for this model type

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        self.states = {i: s.select(index) for i, s in self.states.items()}

    @property
    def state_bytes(self) -> int:
        """Bytes of KDA state held (for all sequences): fixed, whatever the context length."""
        return sum(s.nbytes for s in self.states.values())
