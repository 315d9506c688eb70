"""A context-aware MoE router (`router_context="gated"`): the gate scores experts from the token's hidden state
plus a causal summary of the tokens before it, computed inside the model.

The summary of one MoE layer, for token t with gate input x_t (the post-attention-norm hidden state):
    v_t = W_v x_t + b_v                      d = router_context_dim channels, in ROUTER_CONTEXT_HEADS heads
    u_t = sigmoid(W_g x_t + b_g) * v_t       a write gate per head: what a token puts into the summary
    c_t = sum_{s = t-W+1 .. t} (1 - r) r^(t-s) u_s        W = router_context_window; r = sigmoid(rho), per head
    logits_t = W_gate x_t + U c_t
multi-scale moving averages of gated writes: a head with slow decay that learns to write on `def` lines and little
elsewhere carries the latest signature through the body. The decays are learned per head and start at r = 1 - 1/tau
for tau = 2, 8, 32, 128 tokens; U starts at zero, so an untrained context router routes exactly as the standard one.
(A decay that also depends on the token, like a selective state space model's, needs [heads, T, T] elementwise passes:
~40 ms forward + backward per MoE layer of the `small` preset at 16 x 128 tokens on one core of this CPU, ~12% of a
training step; a per-head decay makes the weights one Toeplitz matrix per head, applied as one batched matmul.)

State: the cache protocol's per-token entries. Each token appends one entry `router_ctx` = u_t ([B, T, d], in the
model dtype) at cache slot `context_slot(layer_idx)`; a step recomputes its tokens' summaries from the last W entries
the cache returns. Training, prefill and decode (the engine's paged cache included) therefore compute the same
function, a rollback or preemption needs nothing extra, and a zero entry (padding, the engine's empty slot)
contributes nothing. Every path reads the entries as stored (rounded to the model dtype).

Checkpoint tensors (beside the standard `mlp.gate.weight` / `mlp.gate.e_score_correction_bias`), per MoE layer L:
    model.layers.L.mlp.gate.context_proj.weight   [d + heads, hidden]   rows: W_v, then W_g
    model.layers.L.mlp.gate.context_proj.bias     [d + heads]           b_v, then b_g
    model.layers.L.mlp.gate.context_decay         [heads]               rho
    model.layers.L.mlp.gate.context_weight        [n_routed_experts, d] U
config.json keys, under "openglm": router_context, router_context_dim, router_context_window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.config import ROUTER_CONTEXT_HEADS, ModelConfig
from openglm.model.router import Router

CONTEXT_SLOT_BASE = 1 << 20  # cache slots of router state: far above every layer index (next-n layers included)
ENTRY = "router_ctx"
INITIAL_MEMORY = (2.0, 8.0, 32.0, 128.0)  # each head's initial mean memory in tokens (cycled over the heads)
QUERY_CHUNK = 256  # tokens whose summaries are computed together (bounds the [heads, chunk, chunk + W] weights)


def context_slot(layer_idx: int) -> int:
    """The cache slot that holds layer `layer_idx`'s router state."""
    return CONTEXT_SLOT_BASE + layer_idx


class ContextRouter(Router):
    has_context = True

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg)
        self.layer_idx, self.window = layer_idx, cfg.router_context_window
        self.dim, self.heads = cfg.router_context_dim, ROUTER_CONTEXT_HEADS
        self.context_proj = ContextProjection(cfg.hidden_size, self.dim + self.heads)
        self.context_decay = nn.Parameter(torch.empty(self.heads))
        self.context_weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, self.dim))
        self.reset_context(cfg.initializer_range)

    @torch.no_grad()
    def reset_context(self, std: float) -> None:
        """Initial context parameters, drawn from a generator of their own (seeded from torch's initial seed and the
        layer) so the rest of the model draws the same weights as a standard-router model of the same seed."""
        if self.context_proj.weight.is_meta:
            return
        g = torch.Generator().manual_seed((torch.initial_seed() * 1_000_003 + self.layer_idx) % (1 << 63))
        self.context_proj.weight.copy_(torch.randn(self.context_proj.weight.shape, generator=g) * std)
        self.context_proj.bias.zero_()
        tau = torch.tensor([INITIAL_MEMORY[h % len(INITIAL_MEMORY)] for h in range(self.heads)])
        self.context_decay.copy_(torch.log(tau - 1.0))  # sigmoid(rho) = 1 - 1/tau
        self.context_weight.zero_()

    def context(self, x: torch.Tensor, token_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Logits [B*T, E] from the summaries of x [B, T, H]'s tokens; appends their entries to `cache`."""
        B, T, _ = x.shape
        entry = self.entries(x, token_mask)
        past = 0
        if cache is not None:
            entry = cache.update(context_slot(self.layer_idx), {ENTRY: entry})[ENTRY]
            past = entry.shape[1] - T
        summary = windowed_summary(entry.float(), past, self.window, self.context_decay.float())
        return F.linear(summary, self.context_weight.float()).reshape(B * T, -1)

    def entries(self, x: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        """Each token's gated write u ([B, T, d], x's dtype); zero where token_mask is False (a padding token leaves no
        trace in the summaries)."""
        value, gate = self.context_proj(x.float()).split([self.dim, self.heads], dim=-1)
        u = (value.unflatten(-1, (self.heads, -1)) * gate.sigmoid().unsqueeze(-1)).flatten(-2)
        if token_mask is not None:
            u = u * token_mask.view(*x.shape[:2], 1).to(u.dtype)
        return u.to(x.dtype)


class ContextProjection(nn.Module):
    """W_v and W_g stacked ([d + heads, hidden] and a bias): a module of its own rather than an nn.Linear, so the
    model's generic init leaves the context parameters as `ContextRouter.reset_context` drew them."""

    def __init__(self, hidden: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))
        self.bias = nn.Parameter(torch.empty(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.float(), self.bias.float())


def windowed_summary(entries: torch.Tensor, past: int, window: int, decay: torch.Tensor) -> torch.Tensor:
    """The summaries [B, T, d] of positions past .. past + T - 1 from the entries u [B, past + T, d] of every position
    so far (fp32) and the heads' decay logits rho [heads]: position t sums (1 - r) r^(t-s) u_s over s in
    (t - window, t], r = sigmoid(rho). The weights depend on t - s only: per head one banded Toeplitz block, applied
    to a chunk of QUERY_CHUNK positions at a time as one batched matmul."""
    B, S, d = entries.shape
    heads = decay.shape[0]
    first = max(0, past - window + 1)  # the earliest position a new token reaches back to
    u = entries[:, first:].unflatten(-1, (heads, -1)).permute(2, 1, 0, 3).flatten(2)  # [heads, S', B * d/heads]
    log_r, keep = F.logsigmoid(decay)[:, None, None], -torch.expm1(F.logsigmoid(decay))[:, None, None]
    out = []
    for q0 in range(past - first, S - first, QUERY_CHUNK):
        q1 = min(q0 + QUERY_CHUNK, S - first)
        k0 = max(0, q0 - window + 1)
        lag = torch.arange(q0, q1, device=entries.device)[:, None] - torch.arange(k0, q1, device=entries.device)
        reach = (lag >= 0) & (lag < window)
        weights = torch.where(reach, keep * torch.exp(log_r * lag.clamp(min=0)), 0.0)  # [heads, q, k]
        out.append(weights @ u[:, k0:q1])  # [heads, q1 - q0, B * d/heads]
    summary = torch.cat(out, dim=1)  # [heads, T, B * d/heads]
    return summary.unflatten(-1, (B, -1)).permute(2, 1, 0, 3).flatten(2)
