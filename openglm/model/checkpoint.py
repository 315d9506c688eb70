"""Hugging Face checkpoints: `load_model(path)` and `save_pretrained(model, path)`.

Layout: config.json + model.safetensors, or shards model-0000i-of-0000n.safetensors listed in
model.safetensors.index.json. Loading memory-maps the shards and checks the total size against
available memory before reading anything; saving writes a sibling temp directory and renames it
into place, so a crash mid-save never leaves a half checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from openglm.model import weights
from openglm.model.config import ModelConfig
from openglm.model.errors import (CheckpointError, CheckpointTooLargeError, MissingShardError,
                                  MissingTensorError, UnexpectedTensorError)
from openglm.model.model import GlmMoeDsaForCausalLM
from openglm.model.rope import RotaryEmbedding
from openglm.util.files import replace_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "F8_E4M3": 1, "U8": 1}


def save_pretrained(model: GlmMoeDsaForCausalLM, path, max_shard_size: int = 2 << 30) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = _hf_state_dict(model)
    shards = _split(tensors, max_shard_size)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        cfg = model.config.to_hf_dict()
        cfg["dtype"] = str(model.dtype).removeprefix("torch.")
        _write_json(tmp / "config.json", cfg)
        names = [SINGLE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
            _write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hf_state_dict(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for hf_name, piece in weights.to_hf(name, t.detach()):
            # Expert slices share storage with the stacked tensor; safetensors wants separate storage.
            out[hf_name] = piece.contiguous() if piece is t else piece.clone()
    return out


def _split(tensors: dict, max_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    return shards + [current]


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a step folder, a run folder, or its checkpoints/ folder."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    for pointer in (p / "checkpoints" / "latest", p / "latest"):
        if pointer.is_file():
            target = pointer.parent / pointer.read_text().strip()
            if (target / "config.json").is_file():
                return target
            raise CheckpointError(f"{pointer} points at {target}, which is not a complete checkpoint")
    raise CheckpointError(f"no checkpoint at {p} (expected config.json, or checkpoints/latest in a run folder)")


def read_config(path) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise MissingShardError(f"{cfg_file}: no config.json (is {path} a Hugging Face checkpoint directory?)")
    try:
        return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from e


def shard_files(path) -> list[Path]:
    path = Path(path)
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        files = [path / f for f in dict.fromkeys(weight_map.values())]
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        raise MissingShardError(f"{path}: neither {SINGLE} nor {INDEX} found")
    for f in files:
        if not f.is_file():
            raise MissingShardError(f"{f}: shard listed in {INDEX} is missing")
    return files


def load_model(path, dtype: torch.dtype | str | None = None, device: str = "cpu",
               max_memory: int | None = None) -> GlmMoeDsaForCausalLM:
    """Load a Hugging Face `glm_moe_dsa` checkpoint directory into GlmMoeDsaForCausalLM (eval mode)."""
    cfg = read_config(path)
    files = shard_files(path)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    with ExitStack() as stack:
        handles = {}
        for f in files:
            h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            handles.update({k: h for k in h.keys()})
        _check_memory(files, handles, dtype, max_memory)
        with torch.device("meta"):
            model = GlmMoeDsaForCausalLM(cfg)
        state, used = {}, set()
        for name, p in model.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            try:
                t, names = weights.load_native(name, p.shape, lambda k: handles[k].get_tensor(k), handles.__contains__)
            except KeyError as e:
                raise MissingTensorError(f"checkpoint {path} lacks tensor {e.args[0]!r}") from None
            used.update(names)
            target = torch.float32 if name.endswith("e_score_correction_bias") else (dtype or t.dtype)
            state[name] = t.to(device=device, dtype=target)
        extra = [k for k in handles if k not in used and not weights.is_extra_layer(k, cfg.num_hidden_layers)]
        if extra:
            raise UnexpectedTensorError(f"checkpoint {path} has tensor(s) the config does not use: {extra[:5]}")
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)  # non-persistent buffer: rebuild off meta
    return model.eval()


def _check_memory(files, handles, dtype, max_memory) -> None:
    """Refuse up front when the weights would not fit (instead of swapping mid-load)."""
    need = 0
    for k, h in handles.items():
        sl = h.get_slice(k)
        n = 1
        for d in sl.get_shape():
            n *= d
        size = torch.empty((), dtype=dtype).element_size() if dtype is not None else _SIZES.get(sl.get_dtype(), 4)
        need += n * size
    avail = max_memory if max_memory is not None else psutil.virtual_memory().available
    if need > avail:
        raise CheckpointTooLargeError(
            f"checkpoint {files[0].parent} needs {need / 2**30:.2f} GiB of weights but only "
            f"{avail / 2**30:.2f} GiB of memory is available; refusing to load (pick a smaller dtype or machine)")
