"""Feed-forward blocks: the dense SwiGLU MLP and the MoE layer (router + routed + shared experts).

Routed experts are computed grouped by expert: the (token, expert) assignments are sorted by
expert, each active expert runs one matmul over its contiguous slice, and results are scattered
back with index_add. No expert ever sees a token not routed to it, and there is no loop over tokens.
An optional capacity factor keeps only the first `capacity` assignments per expert (in token order).
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.config import ModelConfig
from openglm.model.native import max_rows, swiglu, swiglu_ok
from openglm.model.router import Router, balance_losses
from openglm.model.derived import fused_rows

ACT = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
FEW_ROWS = 4  # experts with at most this many rows (decode) take the small-matmul path
SMALL_BATCH = 64  # at most this many (token, expert) assignments: sort them in Python (see _forward_small)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x):
        # Without autograd, gate and up (which read the same x) are one matmul over their stacked weights.
        w = None if torch.is_grad_enabled() else fused_rows(self, "gate_up", [self.gate_proj, self.up_proj])
        if w is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        rows = x.reshape(-1, x.shape[-1])
        if self.act is F.silu and rows.shape[0] <= max_rows() and swiglu_ok(x, w, self.down_proj.weight):
            return swiglu(rows, [rows.shape[0]], w, self.down_proj.weight).view(x.shape)
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        self.act = ACT[cfg.hidden_act]

    def forward(self, x, indices, weights, capacity: int | None = None):
        """x [N,H]; indices/weights [N,k]. Returns (out [N,H], number of dropped assignments)."""
        N, k = indices.shape
        E = self.gate_up_proj.shape[0]
        if capacity is None and N * k <= SMALL_BATCH:
            return self._forward_small(x, indices, weights), 0
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
        ys = self._grouped(x.index_select(0, tokens), counts.tolist())
        # Each row times its routing weight, summed into its token by index_add: 1.5-5x faster than undoing
        # the sort and a [N, 1, k] x [N, k, H] bmm (bf16 most), and it accumulates in the model dtype as
        # transformers' loop does.
        w = weights.reshape(-1)[rows].to(ys.dtype).unsqueeze(1)
        ys = ys * w if torch.is_grad_enabled() else ys.mul_(w)  # in place: a fresh bf16 product cost ~7x more
        return torch.zeros(N, ys.shape[1], dtype=ys.dtype, device=ys.device).index_add_(0, tokens, ys), dropped

    def _forward_small(self, x, indices, weights):
        """`forward` for a handful of assignments (decode): the expert sort done on a Python list, since
        argsort/bincount/gather kernels on a few dozen elements cost more in dispatch than they compute."""
        N, k = indices.shape
        flat = indices.view(-1).tolist()
        order = sorted(range(len(flat)), key=flat.__getitem__)  # stable: token order inside an expert
        counts = [0] * self.gate_up_proj.shape[0]
        for e in flat:
            counts[e] += 1
        ys = self._grouped(x.index_select(0, torch.tensor([i // k for i in order], device=x.device)), counts)
        y = torch.empty_like(ys).index_copy_(0, torch.tensor(order, device=x.device), ys).view(N, k, ys.shape[-1])
        # The weighted sum in fp32 (the weights are fp32): a bf16 bmm this small costs ~4x more in oneDNN.
        return torch.bmm(weights.unsqueeze(1), y.float()).squeeze(1).to(x.dtype)

    def _grouped(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One SwiGLU per active expert over its contiguous slice of the expert-sorted rows."""
        ys = torch.empty_like(xs)
        # The in-place path writes matmul results straight into `ys`, so it needs the matmuls to run in
        # `ys`'s dtype: not under autocast (e.g. bf16 validation of an fp32 model), which changes it.
        if not torch.is_grad_enabled() and not torch.is_autocast_enabled(xs.device.type):
            return self._grouped_inference(xs, counts, ys)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                ys[start:start + n] = F.linear(self.act(gate) * up, self.down_proj[e])
                start += n
        return ys

    def _grouped_inference(self, xs: torch.Tensor, counts: list[int], ys: torch.Tensor) -> torch.Tensor:
        """`_grouped` without autograd: fewer ops per expert (in-place activation, results written
        straight into `ys`), which is what a decode step with ~1 token per expert is bound by."""
        if (self.act is F.silu and 0 < max(counts) <= max_rows()
                and swiglu_ok(xs, self.gate_up_proj, self.down_proj)):
            return swiglu(xs, counts, self.gate_up_proj, self.down_proj)
        if 0 < max(counts) <= FEW_ROWS and self._grouped_mm_ok(xs.dtype):
            if xs.dtype == torch.float32:
                return self._grouped_mm(xs, counts)
            with _without_onednn():  # see below: ATen's gemm is the faster one for a few bf16 rows
                return self._grouped_mm(xs, counts)
        if xs.dtype == torch.bfloat16 and min((n for n in counts if n), default=0) > FEW_ROWS and self._grouped_mm_ok(xs.dtype):
            return self._grouped_mm(xs, counts)  # prefill: ~1.1x the per-expert loop in bf16 (fp32: slower)
        active = [(e, x, y) for e, (x, y) in enumerate(zip(xs.split(counts), ys.split(counts))) if len(x)]
        few = [a for a in active if len(a[1]) <= FEW_ROWS]
        many = [a for a in active if len(a[1]) > FEW_ROWS]
        if few and xs.dtype in (torch.bfloat16, torch.float16):
            # oneDNN spends ~40us setting up each reduced-precision matmul of a handful of rows; ATen's
            # own gemm does one in ~10us (larger row counts are faster through oneDNN again).
            with _without_onednn():
                self._swiglu_rows(few)
        else:
            many = few + many
        self._swiglu_rows(many)
        return ys

    def _grouped_mm_ok(self, dtype: torch.dtype) -> bool:
        # torch._grouped_mm (private, CPU support since torch 2.8) needs 16-byte-aligned row strides.
        E, H, inter = self.down_proj.shape
        size = torch.finfo(dtype).bits // 8
        return (hasattr(torch, "_grouped_mm") and dtype in (torch.float32, torch.bfloat16)
                and (H * size) % 16 == 0 and (inter * size) % 16 == 0)

    def _grouped_mm(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Decode: the per-expert matmuls as two grouped matmuls (one call each instead of two per active
        expert; measured 1.2-1.5x faster for ~1 row per expert, fp32 and bf16). Group e's rows are
        xs[offsets[e-1]:offsets[e]], and the [E, in, out] weights are transposed views (no copy)."""
        offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=xs.device)
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(self.act(gate).mul_(up), self.down_proj.transpose(1, 2), offs=offsets)

    def _swiglu_rows(self, groups) -> None:
        for e, x, y in groups:
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            torch.mm(self.act(gate).mul_(up), self.down_proj[e].t(), out=y)


@contextmanager
def _without_onednn():
    """Route matmuls to ATen's gemm for the block. (torch.backends.mkldnn.flags does the same but also
    re-sets the TF32 flag, which warns on every CPU-only build.) The switch is process-wide: a matmul
    on another thread meanwhile takes the ATen path too, which changes its speed, not its result."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


@dataclass
class LayerStats:
    losses: dict[str, torch.Tensor]
    counts: torch.Tensor  # [E] assignments per expert (before capacity dropping), real tokens only
    dropped: int
    assigned: int


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.capacity_factor = cfg.capacity_factor
        self.experts = Experts(cfg)
        self.gate = Router(cfg)
        self.shared_experts = (MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        self.stats_reduce = None  # data-parallel training sets it: balance losses over the global batch

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None, with_stats: bool = False):
        """x [B,T,H]; token_mask [B*T] bool (real tokens) or None. Returns (out, LayerStats | None)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        r = self.gate(flat, with_probs=with_stats)
        out, dropped = self.experts(flat, r.indices, r.weights, self.capacity(flat.shape[0]))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        stats = None
        if with_stats:
            real = r.indices if token_mask is None else r.indices[token_mask]
            stats = LayerStats(balance_losses(r, self.n_experts, token_mask, self.stats_reduce),
                               torch.bincount(real.reshape(-1), minlength=self.n_experts), dropped, r.indices.numel())
        return out.view(shape), stats
