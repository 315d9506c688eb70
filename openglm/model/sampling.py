"""Sampling filters over logits, shared by the training-time generator and the serving engine."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) all but the top-k logits and the smallest set whose probability reaches top_p."""
    logits = logits.float().clone()
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly before each token
        sorted_logits[before >= top_p] = float("-inf")  # the top token always survives (before == 0)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits
