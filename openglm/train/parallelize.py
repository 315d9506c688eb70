"""FSDP2 + expert parallelism for training, applied to an unmodified model from outside (torchtitan-style).

Layout `dp=D,ep=P` on D processes (ep borrows its ranks from dp):
- Dense parts (embeddings, attention, dense MLPs, shared experts, routers, norms, LM head) are sharded
  with FSDP2 (`fully_shard`, one unit per decoder layer plus the root) over a 1-D DeviceMesh of all D
  ranks: parameters, gradients and AdamW state are 1/D per rank; gradients are averaged over D.
- Routed experts: with P > 1 every MoE layer's `experts` becomes an `AllToAllExperts` holding E/P experts.
  The ranks form a [D/P replicas, P] mesh: the P ranks of a row are an expert group (tokens move inside
  it with all-to-all), and the ranks of a column hold the same experts; expert gradients are summed over
  the column and divided by D, as FSDP does for the dense parts. FSDP ignores the expert parameters.
  With P = 1 the experts are FSDP-sharded like the rest.
- Balance losses are computed over the global batch (`MoE.stats_reduce`: autograd all-reduce of the
  per-batch statistics), and the router bias update already uses globally summed counts (trainer).
gloo on CPU, nccl on GPU: the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from openglm.model.expert_parallel import AllToAllExperts
from openglm.model.moe import MoE
from openglm.model.parallel import ParallelLayout
from openglm.train.optim import param_groups


@dataclass
class TrainParallel:
    layout: ParallelLayout
    mesh: DeviceMesh  # 1-D, all ranks: FSDP2
    expert_mesh: DeviceMesh  # [replica, ep]: expert groups along "ep"
    expert_params: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # name -> local experts (ep > 1)

    @property
    def ep_group(self):
        return self.expert_mesh.get_group("ep")

    @property
    def replica_group(self):
        return self.expert_mesh.get_group("replica")


def build_meshes(layout: ParallelLayout, device_type: str) -> TrainParallel:
    mesh = init_device_mesh(device_type, (layout.dp,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh(device_type, (layout.dp // layout.ep, layout.ep), mesh_dim_names=("replica", "ep"))
    return TrainParallel(layout, mesh, expert_mesh)


def parallelize(model: torch.nn.Module, par: TrainParallel) -> torch.nn.Module:
    """Expert parallelism on the MoE layers, global balance statistics, then FSDP2 bottom-up."""
    cfg = model.config
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        layer.mlp.stats_reduce = _global_sums
        if par.layout.ep > 1:
            layer.mlp.experts = AllToAllExperts(layer.mlp.experts, par.ep_group, cfg.capacity_factor,
                                                cfg.num_experts_per_tok)
            for name, p in layer.mlp.experts.named_parameters():
                par.expert_params[f"model.layers.{i}.mlp.experts.{name}"] = p
    ignored = set(par.expert_params.values())
    for layer in model.model.layers:
        fully_shard(layer, mesh=par.mesh, ignored_params={p for p in layer.parameters() if p in ignored})
    fully_shard(model, mesh=par.mesh, ignored_params=ignored)
    return model


class _AllReduceSum(torch.autograd.Function):
    """Sum over all ranks; the backward sums the incoming gradients likewise (every rank's loss used the sum)."""

    @staticmethod
    def forward(ctx, t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _global_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The balance-loss statistics summed over all data-parallel ranks; the differentiable ones through an
    autograd all-reduce, whose backward sums each rank's gradient (the FSDP average then divides it back)."""
    out = {}
    for name, t in sums.items():
        if t.requires_grad:
            out[name] = _AllReduceSum.apply(t)
        else:
            t = t.clone()
            dist.all_reduce(t)
            out[name] = t
    return out


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], weight_decay: float):
    # foreach kernels want one tensor kind per call; DTensors (FSDP) and plain local experts are mixed here.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, foreach=False)


def reduce_expert_gradients(par: TrainParallel) -> None:
    """Sum the local experts' gradients over the replicas holding the same experts and divide by dp, the
    scaling FSDP gives the dense gradients. An expert set no token reached gets zeros, as its stacked
    parameter does in one process (where some expert of the layer always receives tokens)."""
    if not par.expert_params:
        return
    grads = []
    for p in par.expert_params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch.cat([g.reshape(-1) for g in grads])
    if par.layout.dp // par.layout.ep > 1:
        dist.all_reduce(flat, group=par.replica_group)
    flat /= par.layout.dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(par: TrainParallel, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients of the (sharded) model: one all-reduce of the local squared sums, each
    expert shard counted once although its D/P replicas hold it."""
    experts = {id(p) for p in par.expert_params.values()}
    replicas = par.layout.dp // par.layout.ep
    local = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        sq = g.detach().double().pow(2).sum().cpu()
        local += sq / replicas if id(p) in experts else sq
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else local.device
    total = local.to(device)
    dist.all_reduce(total)
    return total.sqrt().cpu()


def clip_gradients(par: TrainParallel, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global-norm clipping with torch.nn.utils.clip_grad_norm_'s rule; returns the norm before clipping."""
    norm = global_grad_norm(par, params)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).item()
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return float(norm)
