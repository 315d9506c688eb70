"""Data parallelism under `torchrun`: process group setup and gradient / metric all-reduce.

Gradients are averaged by an explicit all-reduce after the accumulation micro-steps instead of a DDP
wrapper: an MoE step may leave some experts without tokens (no gradient), which DDP's bucketed hooks
treat as an error, and an explicit reduce is easy to read. One flat buffer keeps it to one collective
call per step. NCCL reduces CUDA tensors only, so small CPU-side tensors (metrics, flags) travel through
the current CUDA device there (`_all_reduce`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # setup() started the process group (so teardown ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def setup(device: str) -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    owns = not dist.is_initialized()  # a caller's group (e.g. several runs in one job) is left to the caller
    if owns:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend=backend)
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
    return DistInfo(rank=rank, world=world, local_rank=local, owns_group=owns)


def teardown(info: DistInfo) -> None:
    if info.enabled and info.owns_group and dist.is_initialized():
        dist.barrier()  # no rank closes its gloo connections while a peer still reads (see engine/parallel.py)
        dist.destroy_process_group()


def average_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """Replace every gradient by its mean over ranks.

    A parameter without a gradient on every rank (an untrained module, an expert no rank routed to)
    keeps `grad=None`, exactly as in a single process, so AdamW skips it there too; one with a gradient
    on some ranks only counts zeros for the others.
    """
    if not info.enabled:
        return
    present = _all_reduce(torch.tensor([p.grad is not None for p in params], dtype=torch.float32), dist.ReduceOp.SUM)
    active = [p for p, n in zip(params, present.tolist()) if n > 0]
    for p in active:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not active:
        return
    grads = [p.grad for p in active]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.SUM) if info.enabled else t


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """The reduced copy of `t`, on t's device (via the current CUDA device under NCCL, which needs it)."""
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    work = t.to(on, copy=True)
    dist.all_reduce(work, op=op)
    return work.to(t.device)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True when `flag` is true on at least one rank (keeps early-stop decisions in lockstep)."""
    if not info.enabled:
        return flag
    return bool(_all_reduce(torch.tensor([1.0 if flag else 0.0]), dist.ReduceOp.MAX).item())


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
