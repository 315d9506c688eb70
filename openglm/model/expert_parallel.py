"""Expert parallelism: drop-in replacements for `moe.Experts` that hold only this rank's experts.

`parallelize` code swaps `layer.mlp.experts` for one of these (the MoE layer, its router and the
single-process `Experts` stay untouched), torchtitan-style. Both keep the same call signature,
`forward(x, indices, weights, capacity, ops) -> (out, dropped)`, and run the local experts' SwiGLUs as `ops.experts`
(the forward's paths, `fast.py`).

- `AllToAllExperts` (training: every rank has its own tokens). Each rank sorts its (token, expert)
  assignments by expert, sends every expert's rows to the rank that owns it (one all-to-all, with a
  first all-to-all of the counts), runs its local experts, and sends the results back (a second
  all-to-all); both are autograd all-to-alls, so gradients travel the same way back. Received rows
  are ordered by source rank, then token: with capacity, the first `capacity` rows per expert are kept
  in that order, which is the single-process order of the concatenated batch of the group.
- `ReplicatedTokenExperts` (serving: every rank has the same tokens, as tensor parallelism leaves
  them). A rank computes its local experts for its share of the tokens and the partial outputs are
  summed with one all-reduce; no token moves.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from openglm.model import fast
from openglm.model.moe import Experts


def _local_copy(full: Experts, lo: int, hi: int, into: nn.Module) -> None:
    """Give `into` the stacked weights of experts [lo, hi) of `full` (copies: the full set is freed)."""
    into.gate_up_proj = nn.Parameter(full.gate_up_proj.detach()[lo:hi].clone())
    into.down_proj = nn.Parameter(full.down_proj.detach()[lo:hi].clone())
    into.act, into.limit = full.act, full.limit


class AllToAllExperts(Experts):
    def __init__(self, full: Experts, group: dist.ProcessGroup, capacity_factor: float | None, top_k: int):
        nn.Module.__init__(self)
        self.group, self.ep, self.ep_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.n_experts = full.gate_up_proj.shape[0]
        self.n_local = self.n_experts // self.ep
        self.first = self.ep_rank * self.n_local  # global id of this rank's first expert
        self.capacity_factor, self.top_k = capacity_factor, top_k
        _local_copy(full, self.first, self.first + self.n_local, self)

    def forward(self, x, indices, weights, capacity: int | None = None, ops: fast.Reference | None = None):
        N, k = indices.shape
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments by expert (hence by owning rank), token order inside
        counts = torch.bincount(flat, minlength=self.n_experts)
        recv_counts = torch.empty_like(counts)  # [source rank, local expert] rows this rank receives
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, self.n_local)
        send_split = counts.view(self.ep, self.n_local).sum(1).tolist()
        recv_split = recv_counts.sum(1).tolist()
        rows = x.index_select(0, order // k)
        recv = _all_to_all(rows, recv_split, send_split, self.group)
        by_expert, kept_counts, dropped = self._expert_major(recv_counts, N, capacity is not None)
        ys = (ops or fast.choose(x)).experts(self, recv.index_select(0, by_expert), kept_counts)
        # back to the received (source-major) order; dropped rows stay zero
        back = torch.zeros_like(recv).index_copy(0, by_expert, ys)
        out_rows = _all_to_all(back, send_split, recv_split, self.group)
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        y = out_rows.index_select(0, unsort).view(N, k, x.shape[-1])
        return torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1), dropped

    def _expert_major(self, recv_counts: torch.Tensor, n_tokens: int, capped: bool):
        """Indices into the received rows, grouped by local expert (source rank, then token order inside),
        keeping at most the group capacity per expert; the kept count per expert; the number dropped."""
        c = recv_counts.tolist()  # [source][expert]
        starts, offset = [], 0
        for row in c:
            starts.append([])
            for n in row:
                starts[-1].append(offset)
                offset += n
        cap = None
        if capped:  # the capacity of the group's whole batch, as one process computes it for that batch
            cap = max(1, math.ceil(self.capacity_factor * n_tokens * self.ep * self.top_k / self.n_experts))
        pieces, kept, dropped = [], [], 0
        for e in range(self.n_local):
            room = cap
            n_kept = 0
            for s in range(self.ep):
                n = c[s][e] if room is None else min(c[s][e], room)
                if n:
                    pieces.append(torch.arange(starts[s][e], starts[s][e] + n))
                n_kept += n
                dropped += c[s][e] - n
                if room is not None:
                    room -= n
            kept.append(n_kept)
        index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return index.to(recv_counts.device), kept, dropped


class ReplicatedTokenExperts(Experts):
    """Experts [shard * E/ep, (shard + 1) * E/ep) on every rank of `group` whose index % ep == shard;
    the ranks holding the same shard split the tokens round-robin."""

    def __init__(self, full: Experts, group: dist.ProcessGroup, ep: int):
        nn.Module.__init__(self)
        self.group = group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.n_experts = full.gate_up_proj.shape[0]
        self.n_local = self.n_experts // ep
        self.shard, self.replica, self.n_replicas = rank % ep, rank // ep, world // ep
        self.first = self.shard * self.n_local
        _local_copy(full, self.first, self.first + self.n_local, self)

    def forward(self, x, indices, weights, capacity: int | None = None, ops: fast.Reference | None = None):
        N, k = indices.shape
        flat = indices.reshape(-1)
        kept, dropped = _capacity_mask(flat, self.n_experts, capacity)
        token = torch.arange(N * k, device=x.device) // k
        mine = (flat // self.n_local == self.shard) & (token % self.n_replicas == self.replica)
        if kept is not None:
            mine &= kept
        picked = mine.nonzero().squeeze(1)
        local = flat[picked] - self.first
        picked = picked[torch.argsort(local, stable=True)]
        counts = torch.bincount(local, minlength=self.n_local).tolist()
        ys = (ops or fast.choose(x)).experts(self, x.index_select(0, token[picked]), counts)
        out = torch.zeros_like(x).index_add_(0, token[picked], ys * weights.reshape(-1)[picked, None].to(ys.dtype))
        dist.all_reduce(out, group=self.group)
        return out, dropped


def _all_to_all(rows: torch.Tensor, out_split: list[int], in_split: list[int], group) -> torch.Tensor:
    """torch's differentiable all-to-all (its backward is the reverse exchange), waited for here."""
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), out_split, in_split, group))


def _capacity_mask(flat: torch.Tensor, n_experts: int, capacity: int | None):
    """Which assignments the single-process capacity rule keeps (the first `capacity` per expert, in token
    order), and how many it drops; (None, 0) when dropless."""
    if capacity is None:
        return None, 0
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(order)
    rank_in_expert[order] = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
    return rank_in_expert < capacity, int((counts - counts.clamp(max=capacity)).sum())
