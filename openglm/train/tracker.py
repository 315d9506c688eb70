"""Per-interval training statistics: losses, norms, throughput, and MoE routing (load, CV, drops, collapse)."""

from __future__ import annotations

import math

import numpy as np
import torch

from openglm.train import dist
from openglm.train.telemetry import CollapseDetector, load_cv, token_shares

ROUTER_SUFFIX = "mlp.gate.weight"  # the router's projection in the Hugging Face tensor names


class StepTracker:
    """Accumulates what happens between two log points and turns it into one metrics record."""

    def __init__(self, model_config, cfg, info: dist.DistInfo):
        self.cfg, self.info = cfg, info
        self.top_k = model_config.num_experts_per_tok
        # moe_layers, not first_k_dense_replace: an explicit mlp_layer_types may interleave dense layers.
        self.detector = CollapseDetector(
            top_k=self.top_k, share_threshold=cfg.collapse_share, patience=cfg.collapse_patience,
            layer_names=[f"layer {layer} (MoE layer {i})" for i, layer in enumerate(model_config.moe_layers)])
        self._router_params = None
        self._reset()

    def _reset(self) -> None:
        self.counts = None
        self.dropped, self.micro = 0.0, 0
        self.rows: list[tuple] = []
        self.seconds = 0.0

    def state_dict(self) -> dict:
        """The open interval and the collapse detector's streaks: a resume at any step (a --time-budget stop,
        a step between two log points) then logs the same curve as an uninterrupted run."""
        d = self.detector
        return {"counts": self.counts, "dropped": self.dropped, "micro": self.micro,
                "rows": [list(r) for r in self.rows], "seconds": self.seconds,
                "streak": [[layer, e, n] for (layer, e), n in d.streak.items()],
                "fired": [list(key) for key in sorted(d.fired)]}

    def load_state_dict(self, state: dict) -> None:
        self.counts, self.dropped, self.micro = state["counts"], float(state["dropped"]), int(state["micro"])
        self.rows = [tuple(float(x) for x in r) for r in state["rows"]]
        self.seconds = float(state["seconds"])
        self.detector.streak = {(int(layer), int(e)): int(n) for layer, e, n in state["streak"]}
        self.detector.fired = {(int(layer), int(e)) for layer, e in state["fired"]}

    def add_routing(self, aux) -> torch.Tensor | None:
        """Record one micro-step's routing; returns its expert counts [n_moe_layers, E] (fp64, CPU) or None."""
        if aux is None or aux.expert_counts is None or aux.expert_counts.numel() == 0:
            return None
        counts = aux.expert_counts.detach().double().cpu()
        self.counts = counts if self.counts is None else self.counts + counts
        self.dropped += float(aux.dropped_fraction)
        self.micro += 1
        return counts

    def add_step(self, lm_loss: float, aux_loss: float, grad_norm: float, router_norm: float, lr: float,
                 mtp_loss: float | None = None) -> None:
        """mtp_loss: the next-n layer's (unweighted) cross-entropy on token t+2, when the model trains one."""
        self.rows.append((lm_loss, aux_loss, grad_norm, router_norm, lr, math.nan if mtp_loss is None else mtp_loss))

    def add_time(self, seconds: float) -> None:
        self.seconds += seconds

    def router_grad_norm(self, model: torch.nn.Module) -> float:
        """Global norm of the routers' gradients (a dead or exploding router shows here first)."""
        if self._router_params is None:
            self._router_params = [p for n, p in model.named_parameters() if n.endswith(ROUTER_SUFFIX)]
        grads = [p.grad.detach().float().norm() for p in self._router_params if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def flush(self, step: int) -> tuple[dict, list[str]]:
        """The record for the interval ending at `step`, plus any collapse warnings; then start afresh."""
        rows = np.asarray(self.rows, dtype=np.float64)
        cfg = self.cfg
        tokens = len(self.rows) * cfg.seq_len * cfg.batch_size * cfg.grad_accum * self.info.world
        record = {"kind": "train", "step": step, "loss": float(rows[:, 0].mean() + rows[:, 1].mean()),
                  "lm_loss": float(rows[:, 0].mean()), "aux_loss": float(rows[:, 1].mean()),
                  "grad_norm": float(rows[:, 2].mean()), "router_grad_norm": float(rows[:, 3].mean()),
                  "lr": float(rows[-1, 4]), "tokens_per_s": tokens / self.seconds if self.seconds else 0.0}
        if not np.isnan(rows[:, 5]).all():
            record["mtp_loss"] = float(np.nanmean(rows[:, 5]))
        # the routers' balance losses alone: aux_loss also holds the MTP loss at its weight
        record["balance_loss"] = record["aux_loss"] - cfg.mtp_loss_weight * record.get("mtp_loss", 0.0)
        warnings = []
        if self.counts is not None:
            counts = dist.all_reduce_sum(self.counts, self.info).numpy()
            dropped = dist.all_reduce_sum(torch.tensor([self.dropped, self.micro], dtype=torch.float64), self.info)
            shares = token_shares(counts, self.top_k)
            record.update(expert_counts=counts, expert_share=shares.round(4), expert_cv=load_cv(counts).round(4),
                          max_expert_share=float(shares.max()),
                          dropped_fraction=float(dropped[0] / max(1.0, float(dropped[1]))))
            warnings = self.detector.update(counts, step=step)
            if warnings:
                record["warnings"] = warnings
        self._reset()
        return record, warnings
