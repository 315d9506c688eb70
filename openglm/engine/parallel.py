"""Tensor + expert parallel serving on torch.distributed (gloo: openglm's engine runs on the CPU).

Layout `tp=T,ep=P` on T processes (`check_serving_layout`), each holding the same loaded checkpoint, then
sharded in place:
- attention: heads split T ways (column-parallel q_b_proj and kv_b_proj, row-parallel o_proj); MLA's
  latent KV cache is shared by all heads, so every rank keeps the full (small) latent cache;
- dense MLPs and shared experts: column-parallel gate/up, row-parallel down;
- one all-reduce after each row-parallel output; embeddings, norms, routers, the DSA indexer and the LM
  head stay replicated (they are small next to the experts or, for the LM head, avoid a gather);
- routed experts: `ReplicatedTokenExperts`, E/P experts per rank (ranks r with r % P equal share a set and
  split the tokens), one all-reduce.
Rank 0 runs the scheduler, sampler and HTTP server; its model runner broadcasts every step's inputs
(token ids, positions, block tables: plain data) and the other ranks run the same model call on their own
KV pool. Greedy outputs equal one process's (the sums run in another order, so logits may differ in the
last bits).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from openglm.engine.model_runner import ModelRunner, StepInputs
from openglm.model.expert_parallel import ReplicatedTokenExperts
from openglm.model.moe import MLP, MoE
from openglm.model.parallel import LayoutError, ParallelLayout


def check_shardable(cfg, world: int) -> None:
    """LayoutError unless this engine can shard `cfg`'s layers over `world` processes (checked before any
    process group starts)."""
    if world > 1 and any(cfg.is_linear(i) for i in range(cfg.num_hidden_layers)):
        raise LayoutError(f"{cfg.model_type}: openglm's engine does not shard linear-attention (KDA) layers over "
                          f"{world} processes; serve it on one process (tensor_parallel: 1)")


def shard_for_serving(model: nn.Module, layout: ParallelLayout) -> nn.Module:
    """Shard `model` in place for this rank of the default process group (a no-op on one process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return model
    rank = dist.get_rank()
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, rank, layout.tp)
        if isinstance(layer.mlp, MoE):
            if layer.mlp.shared_experts is not None:
                _shard_mlp(layer.mlp.shared_experts, rank, layout.tp)
            layer.mlp.experts = ReplicatedTokenExperts(layer.mlp.experts, dist.group.WORLD, layout.ep)
        else:
            _shard_mlp(layer.mlp, rank, layout.tp)
    return model


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    out, inp = weight.shape
    lin = nn.Linear(inp, out, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return lin


def _rows(w: torch.Tensor, groups: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's share of the output rows of w [groups * g, in] (whole groups, e.g. heads)."""
    per = groups // tp
    return w.view(groups, -1, w.shape[-1])[rank * per:(rank + 1) * per].reshape(-1, w.shape[-1])


def _all_reduce_output(module: nn.Module, args, output):
    if isinstance(output, tuple):  # attention returns (output, DSA selection)
        dist.all_reduce(output[0])
        return output
    dist.all_reduce(output)
    return output


def _shard_attention(attn: nn.Module, rank: int, tp: int) -> None:
    H, v = attn.n_heads, attn.v_dim
    per = H // tp
    attn.q_b_proj = _linear(_rows(attn.q_b_proj.weight.detach(), H, rank, tp))
    attn.kv_b_proj = _linear(_rows(attn.kv_b_proj.weight.detach(), H, rank, tp))
    o = attn.o_proj
    bias = None
    if o.bias is not None:  # added once: on rank 0, zeros elsewhere, so the all-reduce sums it once
        bias = o.bias.detach() if rank == 0 else torch.zeros_like(o.bias)
    attn.o_proj = _linear(o.weight.detach()[:, rank * per * v:(rank + 1) * per * v], bias)
    attn.n_heads = per
    attn.__dict__.pop("_derived_weights", None)  # fused inference weights are rebuilt from the shards
    attn.register_forward_hook(_all_reduce_output)


def _shard_mlp(mlp: MLP, rank: int, tp: int) -> None:
    inter = mlp.gate_proj.out_features
    per = inter // tp
    cols = slice(rank * per, (rank + 1) * per)
    mlp.gate_proj = _linear(mlp.gate_proj.weight.detach()[cols])
    mlp.up_proj = _linear(mlp.up_proj.weight.detach()[cols])
    mlp.down_proj = _linear(mlp.down_proj.weight.detach()[:, cols])
    mlp.__dict__.pop("_derived_weights", None)
    mlp.register_forward_hook(_all_reduce_output)


class BroadcastingModelRunner(ModelRunner):
    """Rank 0's runner: every model call is first broadcast to the other ranks (`follow_steps`)."""

    def execute(self, step: StepInputs) -> torch.Tensor:
        dist.broadcast_object_list([step], src=0)
        return super().execute(step)

    def stop_followers(self) -> None:
        """Tell the followers to return from `follow_steps`, then leave the group with them (`leave_group`)."""
        dist.broadcast_object_list([None], src=0)
        leave_group()


@torch.inference_mode()
def follow_steps(runner: ModelRunner) -> None:
    """Ranks > 0: run every model call rank 0 broadcasts, until it broadcasts None (shutdown), then leave."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            leave_group()
            return
        runner.execute(message[0])


def exit_rank() -> NoReturn:
    """A torchrun rank's end once it has left the group (`leave_group`) and saved what it has: exit without the
    interpreter's teardown. A rank aborted with `terminate called without an active exception` in that teardown
    after the work was done, failing the torchrun job: a follower in one of stop 22's CI runs and one of three on
    2026-12-04, and, once followers exited this way, rank 0 in one of five CI runs later that day. The likely
    cause is the gloo group, still referenced by the sharded experts, destroyed during interpreter shutdown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def leave_group() -> None:
    """Every rank: wait until all ranks are done, then destroy the process group. Without the barrier a rank
    that tears down its gloo connections first can reset a peer that is still reading the last message
    (seen as a follower aborting with `terminate called without an active exception` on a loaded machine)."""
    dist.barrier()
    dist.destroy_process_group()
