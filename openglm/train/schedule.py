"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based). A pure function of the step: resume is exact."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = base_lr * min_lr_ratio
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
