"""Training telemetry: metrics JSONL, per-layer expert load statistics, and the collapse detector.

Expert load is measured as each expert's *token share*: the fraction of the layer's tokens that
picked the expert among their top-k (counts / (routed assignments / k)). A balanced layer gives
every expert k / n_experts; a collapsed one has an expert near 1.0 and others near 0 (the write-ups' symptom:
"some experts > 90% utilised while others < 10%").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from openglm.util.files import write_atomic


def token_shares(counts: np.ndarray, top_k: int) -> np.ndarray:
    """[layers, experts] routed-token counts -> fraction of each layer's tokens sent to each expert."""
    counts = np.asarray(counts, dtype=np.float64)
    tokens = counts.sum(axis=1, keepdims=True) / max(1, top_k)
    return np.divide(counts, tokens, out=np.zeros_like(counts), where=tokens > 0)


def load_cv(counts: np.ndarray) -> np.ndarray:
    """Coefficient of variation (std / mean) of the load over experts, per layer (0 = perfectly even)."""
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean(axis=1)
    return np.divide(counts.std(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)


@dataclass
class CollapseDetector:
    """Warns when an expert's token share stays above `share_threshold` for `patience` checks in a row.

    `layer_names[i]` names MoE layer i in messages (the model's layer index), so the warning points at
    the exact place to look.
    """

    top_k: int
    share_threshold: float = 0.9
    patience: int = 3
    layer_names: list[str] | None = None
    starved_below: float = 0.1  # experts under this fraction of the even share are named as starved
    streak: dict = field(default_factory=dict)  # (layer, expert) -> consecutive checks over threshold
    fired: set = field(default_factory=set)

    def update(self, counts: np.ndarray, step: int | None = None) -> list[str]:
        """Feed one interval's [layers, experts] counts; return the warnings that fire now."""
        shares = token_shares(counts, self.top_k)
        n_layers, n_experts = shares.shape
        even = self.top_k / n_experts
        warnings = []
        for layer in range(n_layers):
            hot = [e for e in range(n_experts) if shares[layer, e] > self.share_threshold]
            for e in range(n_experts):
                key = (layer, e)
                self.streak[key] = self.streak.get(key, 0) + 1 if e in hot else 0
                if e not in hot:
                    self.fired.discard(key)
            ready = [e for e in hot if self.streak[(layer, e)] >= self.patience and (layer, e) not in self.fired]
            if ready:
                self.fired.update((layer, e) for e in ready)
                starved = [e for e in range(n_experts) if shares[layer, e] < self.starved_below * even]
                warnings.append(self._message(layer, ready, starved, shares[layer], step))
        return warnings

    def _message(self, layer: int, hot: list[int], starved: list[int], shares: np.ndarray, step) -> str:
        name = self.layer_names[layer] if self.layer_names else f"MoE layer {layer}"
        hot_txt = ", ".join(f"expert {e} ({shares[e]:.0%} of tokens)" for e in hot)
        starved_txt = (f"; starved: experts {', '.join(map(str, starved))} (< {self.starved_below:.0%} of the even "
                       f"share)" if starved else "")
        at = f" at step {step}" if step is not None else ""
        return (f"expert collapse in {name}{at}: {hot_txt} above {self.share_threshold:.0%} for "
                f"{self.patience} consecutive checks (even share would be {self.top_k / len(shares):.0%})"
                f"{starved_txt}. Remedies: raise the balance-loss weight (model config aux-loss coefficient), "
                f"raise the capacity factor, check the router's gradients (router_grad_norm in metrics.jsonl), "
                f"lower the learning rate.")


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl` (flushed per record; safe to tail)."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume, drop records logged after the checkpoint's step (they will be re-done)."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        write_atomic(self.path, "".join(line + "\n" for line in keep))


def read_metrics(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line] if p.exists() else []


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"cannot serialise {type(x).__name__} to JSON")
