"""Atomic training checkpoints in the Hugging Face layout plus the trainer's state.

    <out_dir>/checkpoints/step_0000100/   config.json, model.safetensors (model.save_pretrained),
                                          tokenizer files, trainer_state.pt (optimizer, step, RNG,
                                          data position, train config)
    <out_dir>/checkpoints/latest          name of the newest complete checkpoint

A checkpoint is written into a hidden temp folder and renamed into place only when complete; `latest`
is then replaced atomically. A kill at any moment leaves the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch

from openglm.model.errors import CheckpointError
from openglm.model.save import save_pretrained
from openglm.util.files import replace_dir, restore_replaced_dir, write_atomic

STATE_FILE = "trainer_state.pt"


def save_checkpoint(out_dir: str | os.PathLike, step: int, model, trainer_state: dict, tokenizer=None,
                    keep: int = 2, before_commit=None) -> Path:
    """Write checkpoint `step` atomically; prune all but the newest `keep`. Returns its folder.
    before_commit(tmp_folder): adds more files (e.g. distributed shards) before the folder is renamed into place."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    try:
        save_pretrained(model, tmp, tokenizer=tokenizer)
        torch.save(trainer_state, tmp / STATE_FILE)
        if before_commit is not None:
            before_commit(tmp)
        _fsync_dir(tmp)
        replace_dir(tmp, final)
        write_atomic(root / "latest", final.name + "\n", fsync=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def load_trainer_state(ckpt: Path) -> dict:
    """The trainer state, unpickled with torch's weights-only loader: tensors, numbers, strings and containers
    only, so a crafted file cannot run code."""
    file = Path(ckpt) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{ckpt} has no {STATE_FILE}: it is a model export, not a resumable checkpoint")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # forbidden globals (code), or bytes that are no pickle at all
        raise CheckpointError(f"{file}: not a trainer state openglm can read safely (damaged, or it holds objects "
                              "other than tensors, numbers, strings and containers, "
                              "which are never unpickled)") from None
    except Exception as e:  # RuntimeError / EOFError: a truncated or damaged file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: not a trainer state openglm can read safely ({first})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a dict, got {type(state).__name__}")
    return state


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(folder: Path) -> None:
    for file in folder.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


def _prune(root: Path, keep: int) -> None:
    """Delete old complete checkpoints and the hidden temp folders an earlier crash left (`.tmp-step_*`, the
    model writer's `..tmp-step_*` and `.step_*.tmp-*`, `.old-step_*`), each a full copy of the weights."""
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for p in steps[:-keep] if keep > 0 else []:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)
    for p in list(root.glob(".old-step_*")):  # a re-save killed between its renames: the old copy goes back
        restore_replaced_dir(root / p.name[len(".old-"):].rsplit("-", 1)[0])
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("."):
            shutil.rmtree(p, ignore_errors=True)
