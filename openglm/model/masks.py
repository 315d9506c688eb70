"""Which keys each query may see: causal in cache order, minus padding."""

from __future__ import annotations

import torch


def visible_mask(key_valid: torch.Tensor | None, q_start: int, q_len: int, n_keys: int, batch: int) -> torch.Tensor:
    """Bool [B or 1, q_len, n_keys]: key j is visible to query i (cache index q_start+i) when
    j <= q_start+i and key j is not padding (`key_valid` [B, n_keys], None = no padding)."""
    device = key_valid.device if key_valid is not None else None
    q_idx = torch.arange(q_start, q_start + q_len, device=device)
    mask = torch.arange(n_keys, device=device)[None, :] <= q_idx[:, None]
    mask = mask.unsqueeze(0)
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    return mask


def key_validity(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, past+T] 0/1 mask -> bool key validity, or None when nothing is padded (fast paths)."""
    if attention_mask is None:
        return None
    valid = attention_mask.bool()
    return None if bool(valid.all()) else valid
