"""Checkpoints of an FSDP2 + expert-parallel run: torch.distributed.checkpoint (DCP) for exact resume, plus
the consolidated Hugging Face export that a single-process run writes.

    checkpoints/step_N/   config.json, model.safetensors, tokenizer files   (consolidated, as one process saves)
                          trainer_state.pt                                  (step, data position, RNG, config)
                          distributed/                                      (DCP: model + AdamW state, sharded)

Every rank writes its own shards into DCP (global tensor shapes: the local experts are saved as a DTensor
sharded on the expert dim, so each expert is stored once whatever the replicas); rank 0 then gathers the
full weights, writes the export and moves the DCP folder into the checkpoint before it is renamed into
place, so a checkpoint is either complete or absent (see train/checkpoint.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from openglm.model.errors import CheckpointError
from openglm.model.model import build_model
from openglm.train.checkpoint import save_checkpoint
from openglm.train.parallelize import TrainParallel

DCP_DIR = "distributed"


def _global_view(par: TrainParallel, name: str, t: torch.Tensor) -> torch.Tensor:
    """A local expert tensor as a DTensor of the full [E, ...] shape (shares storage, so a load fills it)."""
    if name in par.expert_params:
        return DTensor.from_local(t, par.expert_mesh, [Replicate(), Shard(0)], run_check=False)
    return t


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def model_state(par: TrainParallel, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = set(par.expert_params)
    return {n: _global_view(par, n, t.detach() if n in names else t) for n, t in model.state_dict().items()}


def optimizer_state(par: TrainParallel, model: torch.nn.Module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's per-parameter state keyed by parameter name (the names, not positions, make it layout-proof)."""
    names = _param_names(model)
    out = {}
    for p, state in optimizer.state.items():
        name = names[id(p)]
        out[name] = {k: _global_view(par, name, v) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()}
    return out


def prepare_optimizer_state(model: torch.nn.Module, optimizer, names: list[str]) -> None:
    """Empty AdamW state (to be filled by a DCP load) for the parameters that had state when saved."""
    params = dict(model.named_parameters())
    for name in names:
        if name not in params:
            raise CheckpointError(f"the distributed checkpoint has optimizer state for {name!r}, "
                                  "which this model does not have")
        p = params[name]
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}


def full_state_dict(par: TrainParallel, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on every rank (collectives: every rank must call it)."""
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        elif name in par.expert_params:
            parts = [torch.empty_like(t) for _ in range(par.layout.ep)]
            dist.all_gather(parts, t.detach().contiguous(), group=par.ep_group)
            t = torch.cat(parts)
        out[name] = t.detach().cpu()
    return out


def consolidated_model(model_config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    with torch.device("meta"):
        full = build_model(model_config)
    full.load_state_dict(state, assign=True)
    return full


def save(par: TrainParallel, model, optimizer, out_dir: Path, step: int, trainer_state: dict, tokenizer,
         keep: int) -> Path:
    """Write checkpoint `step` (all ranks call this); returns its folder."""
    root = Path(out_dir) / "checkpoints"
    staging = root / f".dcp-step_{step:07d}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_state(par, model), "optim": optimizer_state(par, model, optimizer)},
             checkpoint_id=str(staging))
    full = full_state_dict(par, model)
    if dist.get_rank() == 0:
        names = _param_names(model)
        trainer_state = {**trainer_state, "optimizer_params": sorted(names[id(p)] for p in optimizer.state),
                         "parallel": str(par.layout)}
        save_checkpoint(out_dir, step, consolidated_model(model.config, full), trainer_state, tokenizer,
                        keep=keep, before_commit=lambda tmp: staging.rename(tmp / DCP_DIR))
    dist.barrier()
    return root / f"step_{step:07d}"


def load(par: TrainParallel, model, optimizer, ckpt: Path, trainer_state: dict) -> None:
    """Fill the model and AdamW state in place from checkpoint `ckpt` (all ranks call this)."""
    saved = trainer_state.get("parallel")
    if saved != str(par.layout):
        raise CheckpointError(f"cannot resume from {ckpt}: it was trained with layout {saved or 'none (DDP)'}, "
                              f"this run uses {par.layout}")
    if not (Path(ckpt) / DCP_DIR).is_dir():
        raise CheckpointError(f"{ckpt} has no {DCP_DIR}/ folder: it holds no distributed training state")
    prepare_optimizer_state(model, optimizer, trainer_state["optimizer_params"])
    state = {"model": model_state(par, model), "optim": optimizer_state(par, model, optimizer)}
    dcp.load(state, checkpoint_id=str(Path(ckpt) / DCP_DIR))
    # Tensors loaded in place already sit in the model and optimizer; a 0-dim "step" may come back as a new
    # object, so set the steps from the loaded dict.
    names = _param_names(model)
    for p, s in optimizer.state.items():
        s["step"] = state["optim"][names[id(p)]]["step"]
