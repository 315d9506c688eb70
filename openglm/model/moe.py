"""Feed-forward blocks: the dense SwiGLU MLP and the MoE layer (router + routed + shared experts).

Routed experts are computed grouped by expert: the (token, expert) assignments are sorted by
expert, each active expert runs one matmul over its contiguous slice, and results are scattered
back with index_add. No expert ever sees a token not routed to it, and there is no loop over tokens.
An optional capacity factor keeps only the first `capacity` assignments per expert (in token order).
The SwiGLU products themselves are the forward's `ops` steps (`fast.py`: `mlp`, `experts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model import fast, gpu
from openglm.model.config import ModelConfig
from openglm.model.context_router import ContextRouter
from openglm.model.router import Router, balance_losses

ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
SMALL_BATCH = 64  # at most this many (token, expert) assignments: sort them in Python (see _forward_small)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = ACT[cfg.hidden_act]
        self.limit = cfg.swiglu_limit  # glm5_next clamps gate and up (fast.swiglu)

    def forward(self, x, ops: fast.Reference | None = None):
        """down(act(gate(x)) * up(x)); `ops`: the forward's paths (`fast.choose`; on its own, the module picks)."""
        return (ops or fast.choose(x)).mlp(self, x)


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        self.act = ACT[cfg.hidden_act]
        self.limit = cfg.swiglu_limit  # glm5_next clamps gate and up (fast.swiglu); the native kernels do not

    def forward(self, x, indices, weights, capacity: int | None = None, ops: fast.Reference | None = None):
        """x [N,H]; indices/weights [N,k]. Returns (out [N,H], number of dropped assignments)."""
        if capacity is None and self.limit is None and gpu.wanted(x):  # CUDA: Triton experts (model/gpu.py)
            out = gpu.experts_forward(self, x, indices, weights)
            if out is not None:
                return out, 0
        ops = ops or fast.choose(x)
        N, k = indices.shape
        E = self.gate_up_proj.shape[0]
        if capacity is None and N * k <= SMALL_BATCH:
            return self._forward_small(x, indices, weights, ops), 0
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order inside
        counts = torch.bincount(flat, minlength=E)
        kept, dropped = None, 0
        if capacity is not None:
            starts = torch.cumsum(counts, 0) - counts
            kept = torch.arange(order.numel(), device=x.device) - starts[flat[order]] < capacity
            dropped = int((counts - counts.clamp(max=capacity)).sum())
            counts = counts.clamp(max=capacity)
        rows = order if kept is None else order[kept]  # dropped assignments contribute zero
        tokens = rows // k
        # index_select rather than advanced indexing / index_copy_: a memcpy per row, 2-7x faster here.
        ys = ops.experts(self, x.index_select(0, tokens), counts.tolist())
        # Each row times its routing weight, summed into its token by index_add: 1.5-5x faster than undoing
        # the sort and a [N, 1, k] x [N, k, H] bmm (bf16 most), and it accumulates in the model dtype as
        # transformers' loop does.
        ys = ops.weighted(ys, weights.reshape(-1)[rows].to(ys.dtype).unsqueeze(1))
        return torch.zeros(N, ys.shape[1], dtype=ys.dtype, device=ys.device).index_add_(0, tokens, ys), dropped

    def _forward_small(self, x, indices, weights, ops):
        """`forward` for a handful of assignments (decode): the expert sort done on a Python list, since
        argsort/bincount/gather kernels on a few dozen elements cost more in dispatch than they compute."""
        N, k = indices.shape
        flat = indices.view(-1).tolist()
        order = sorted(range(len(flat)), key=flat.__getitem__)  # stable: token order inside an expert
        counts = [0] * self.gate_up_proj.shape[0]
        for e in flat:
            counts[e] += 1
        ys = ops.experts(self, x.index_select(0, torch.tensor([i // k for i in order], device=x.device)), counts)
        y = torch.empty_like(ys).index_copy_(0, torch.tensor(order, device=x.device), ys).view(N, k, ys.shape[-1])
        # The weighted sum in fp32 (the weights are fp32): a bf16 bmm this small costs ~4x more in oneDNN.
        return torch.bmm(weights.unsqueeze(1), y.float()).squeeze(1).to(x.dtype)


@dataclass
class LayerStats:
    losses: dict[str, torch.Tensor]
    counts: torch.Tensor  # [E] assignments per expert (before capacity dropping), real tokens only
    dropped: int
    assigned: int


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.capacity_factor = cfg.capacity_factor
        self.experts = Experts(cfg)
        self.gate = Router(cfg) if cfg.router_context == "none" else ContextRouter(cfg, layer_idx)
        self.shared_experts = (MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        self.stats_reduce = None  # data-parallel training sets it: balance losses over the global batch

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None, with_stats: bool = False, cache=None,
                ops: fast.Reference | None = None):
        """x [B,T,H]; token_mask [B*T] bool (real tokens) or None; cache: the KV cache (a context-aware router
        keeps its per-token state there); ops: the forward's paths. Returns (out, LayerStats | None)."""
        ops = ops or fast.choose(x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = self.gate(flat, with_probs=with_stats, extra_logits=self.gate.context(x, token_mask, cache))
        out, dropped = self.experts(flat, r.indices, r.weights, self.capacity(flat.shape[0]), ops)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat, ops)
        stats = None
        if with_stats:
            real = r.indices if token_mask is None else r.indices[token_mask]
            stats = LayerStats(balance_losses(r, self.n_experts, token_mask, self.stats_reduce),
                               torch.bincount(real.reshape(-1), minlength=self.n_experts), dropped, r.indices.numel())
        return out.view(shape), stats
