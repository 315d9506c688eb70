"""MoE routers and the balance losses, as options of one router module.

- "sigmoid" (GLM-5 / DeepSeek-V3): sigmoid scores; `e_score_correction_bias` shifts the scores used
  to *choose* experts only; group-limited choice (keep the `topk_group` groups whose top-2 scores sum
  highest, then top-k inside them); gate weights are the unbiased scores, optionally renormalised.
- "softmax" (Switch/Mixtral/the write-ups' "top-2 of 16"): softmax over experts, top-k, optionally
  renormalised.
Both multiply the gates by `routed_scaling_factor`.

Balance losses (computed over real tokens only; N tokens, E experts, k picks per token):
- cv^2 (Shazeer 2017): importance_e = sum_t gate[t,e] (sparse gates), load_e = sum_t p[t,e] (dense
  router probabilities, a smooth stand-in for the paper's noisy load estimate);
  losses cv_importance = CV^2(importance), cv_load = CV^2(load), CV^2 = population var / mean^2.
- switch (Switch Transformer / Mixtral): E * sum_e f_e * P_e, f_e = fraction of the N*k assignments
  that went to e, P_e = mean_t p[t,e]. Equals 1 when routing is perfectly uniform.
- z (ST-MoE router z-loss): mean_t logsumexp(logits_t)^2.
p is the softmax for "softmax" routers and the per-token-normalised sigmoid scores for "sigmoid".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.config import ModelConfig


@dataclass
class Routing:
    logits: torch.Tensor  # [N, E] fp32
    probs: torch.Tensor | None  # [N, E] fp32, rows sum to 1 (for the balance losses; None if not asked for)
    indices: torch.Tensor  # [N, k] chosen experts
    weights: torch.Tensor  # [N, k] gate weights (fp32)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.top_k = cfg.router, cfg.num_experts_per_tok
        self.n_experts, self.n_group, self.topk_group = cfg.n_routed_experts, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # The correction bias stays fp32 whatever dtype the model is cast to (as in the reference).
        super()._apply(fn, recurse)
        bias = self._buffers["e_score_correction_bias"]
        if bias.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = bias.float()
        return self

    has_context = False  # a subclass that also reads the context says so (the native decode step has no such form)

    def context(self, x: torch.Tensor, token_mask: torch.Tensor | None, cache) -> torch.Tensor | None:
        """Logits [B*T, E] this router adds from the context of x [B, T, H] (openglm/model/context_router.py);
        the standard router reads the token's hidden state only."""
        return None

    def forward(self, x: torch.Tensor, with_probs: bool = True, extra_logits: torch.Tensor | None = None) -> Routing:
        """`with_probs=False` skips the balance-loss probabilities (inference without stats); `extra_logits`
        [N, E] are added to the hidden state's logits before scoring (a context-aware router's share)."""
        logits = F.linear(x.float(), self.weight.float())
        if extra_logits is not None:
            logits = logits + extra_logits
        if self.kind == "softmax":
            probs = logits.softmax(-1)
            weights, indices = probs.topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            indices = self._choose(scores + self.e_score_correction_bias.float())
            weights = scores.gather(1, indices)
            probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if with_probs else None
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(logits, probs, indices, weights * self.scaling if self.scaling != 1.0 else weights)

    def _choose(self, s: torch.Tensor) -> torch.Tensor:
        """Group-limited top-k on the bias-corrected scores s [N, E]."""
        if self.n_group > 1:
            per_group = s.view(-1, self.n_group, self.n_experts // self.n_group)
            group_scores = per_group.topk(2, dim=-1)[0].sum(-1)  # [N, G]
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            s = per_group.masked_fill(~group_mask[..., None], float("-inf")).view_as(s)
        return s.topk(self.top_k, dim=-1, sorted=False)[1]


def cv_squared(x: torch.Tensor) -> torch.Tensor:
    """Squared coefficient of variation: population variance / mean^2 (0 when perfectly balanced)."""
    x = x.float()
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


def balance_losses(r: Routing, n_experts: int, token_mask: torch.Tensor | None = None,
                   reduce=None) -> dict[str, torch.Tensor]:
    """Unweighted balance losses of one MoE layer (see the module docstring for definitions).

    reduce: None, or a function that sums the per-batch statistics (a dict of tensors) over the
    data-parallel ranks with autograd, so every rank computes the losses of the global batch."""
    logits, probs, indices, weights = r.logits, r.probs, r.indices, r.weights
    if token_mask is not None:
        logits, probs = logits[token_mask], probs[token_mask]
        indices, weights = indices[token_mask], weights[token_mask]
    n, k = indices.shape
    gates = torch.zeros_like(probs).scatter_add_(1, indices, weights)
    sums = {"gates": gates.sum(0), "probs": probs.sum(0),
            "counts": torch.bincount(indices.reshape(-1), minlength=n_experts).float(),
            "z": torch.logsumexp(logits, dim=-1).pow(2).sum() if n else logits.sum() * 0,
            "n": torch.tensor(float(n), device=logits.device)}
    if reduce is not None:
        sums = reduce(sums)
    n = float(sums["n"])
    f = sums["counts"] / max(n * k, 1)
    return {
        "cv_importance": cv_squared(sums["gates"]),
        "cv_load": cv_squared(sums["probs"]),
        "switch": n_experts * (f * sums["probs"] / n).sum() if n else sums["probs"].sum() * 0,
        "z": sums["z"] / n if n else sums["z"] * 0,
    }
