"""Writing Hugging Face checkpoints: `save_pretrained(model, path, tokenizer=...)` (also `model.save_pretrained`).

Layout: config.json + model.safetensors, or shards model-0000i-of-0000n.safetensors listed in
model.safetensors.index.json; FP8 block-quantised on request (fp8.py). A checkpoint is only usable whole, so the
tokenizer files and chat template are written beside the weights: from a tokenizer object (its `save(folder)`) or
copied from a folder that holds them (the checkpoint a conversion reads). Everything is written into a sibling temp
folder that is renamed into place, so a crash mid-save never leaves a half checkpoint that loads; the folder and
files get the umask's modes (util/files.py), so another user (a container, a serving engine) can read them.

This module does not import the model class (model.py imports it for `GlmMoeDsaForCausalLM.save_pretrained`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from openglm.model import fp8, int4
from openglm.model.errors import CheckpointError
from openglm.model.families import family_of
from openglm.model.hf_names import HFNames, hf_name
from openglm.model.quantized import QuantizedWeight
from openglm.util.files import default_mode, replace_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# What a checkpoint needs beside its weights to be served or sampled: the tokenizer (any of the Hugging Face
# layouts), its chat template, and the generation defaults.
SIDECAR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                 "generation_config.json")
TOKENIZER_FILE = "tokenizer.json"


def save_pretrained(model, path, max_shard_size: int = 2 << 30,
                    quantization: fp8.Fp8Config | int4.Int4Config | None = None, tokenizer=None) -> Path:
    """Write `model` (a GlmMoeDsaForCausalLM) as a Hugging Face checkpoint at `path`; returns the folder. With
    `quantization`, as an FP8 block-quantised one (the format of the -FP8 releases, which vLLM and SGLang serve) or
    an int4 one (`int4.py`).
    `tokenizer`: an openglm Tokenizer (its files and chat template are written), or a folder whose tokenizer files
    are copied (a checkpoint being converted); None writes weights only (not servable without `--tokenizer`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = tokenizer_source(tokenizer, path)
    names = family_of(model.config.model_type).hf_names
    tensors = _hf_state_dict(model, names)
    kept = getattr(model, "vision_extra", {})
    if quantization is not None:
        skip = quantization.modules_to_not_convert
        extra = list(names.fp8_not_convert) + _kept_not_convert(model, kept, names)
        skip = skip + [m for m in extra if m not in skip]
        quantization = (int4.Int4Config(quantization.group, skip) if isinstance(quantization, int4.Int4Config)
                        else fp8.Fp8Config(quantization.block, skip))
        tensors = _quantized(tensors, quantization)
    tensors.update(kept)  # as loaded: the same bytes go back
    shards = _split(tensors, max_shard_size)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        cfg = model.config.to_hf_dict()
        cfg["dtype"] = str(model.dtype).removeprefix("torch.")
        if quantization is not None:
            cfg["quantization_config"] = quantization.to_hf()
        _write_json(tmp / "config.json", cfg)
        files = [SINGLE] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(files, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            os.chmod(tmp / name, default_mode())  # safetensors creates its files 0600
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map = {k: name for name, shard in zip(files, shards) for k in shard}
            _write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if isinstance(source, Path):
            copy_sidecar_files(source, tmp)
        elif source is not None:
            source.save(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def tokenizer_source(tokenizer, dest: Path):
    """A folder to copy tokenizer files from (checked now, before any weight is written), a tokenizer object, or
    None."""
    if tokenizer is None or hasattr(tokenizer, "save"):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(f"tokenizer must be a Tokenizer or a folder, got {type(tokenizer).__name__}")
    folder = Path(tokenizer)
    if folder.is_file() and folder.name == TOKENIZER_FILE:
        folder = folder.parent
    if not (folder / TOKENIZER_FILE).is_file():
        raise CheckpointError(f"tokenizer folder {folder} has no {TOKENIZER_FILE}: cannot write a servable "
                              f"checkpoint to {dest}")
    return folder


def copy_sidecar_files(source: str | os.PathLike, dest: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files, chat template and generation defaults `source` holds into `dest` (new files,
    modes from the umask); returns the names copied."""
    source, dest = Path(source), Path(dest)
    copied = []
    for name in SIDECAR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
            copied.append(name)
    return copied


def _hf_state_dict(model, names: HFNames) -> dict[str, torch.Tensor]:
    out = {}
    n = model.config.num_hidden_layers
    tensors = dict(model.state_dict())  # quantised weights are buffers outside it: written dequantised
    tensors.update((name, b.dequantize()) for name, b in model.named_buffers() if isinstance(b, QuantizedWeight))
    for name, t in tensors.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for disk_name, piece in names.to_hf(hf_name(name, n), t.detach()):
            # Expert slices share storage with the stacked tensor; safetensors wants separate storage.
            out[names.disk(disk_name)] = piece.contiguous() if piece is t else piece.clone()
    for disk_name, t in getattr(model, "mtp_extra", {}).items():
        out[disk_name] = t.detach().contiguous()
    return out


def _kept_not_convert(model, kept: dict[str, torch.Tensor], names: HFNames) -> list[str]:
    """What an FP8 config.json says of the tensors kept as stored (a vision tower): unquantised ones are not
    converted at all; FP8 ones (from an FP8 source) keep the source's word on them."""
    if not kept:
        return []
    if not any(name.endswith(fp8.SCALE_SUFFIX) for name in kept):
        return list(names.kept)
    return list(getattr(model, "kept_not_convert", []))


def _quantized(tensors: dict[str, torch.Tensor], q: fp8.Fp8Config | int4.Int4Config) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if not q.converts(name, t):
            out[name] = t
        elif isinstance(q, int4.Int4Config):
            out[name], out[name + int4.SCALE_SUFFIX] = q.quantize(t)
        else:
            out[name], out[name + fp8.SCALE_SUFFIX] = fp8.quantize(t, q.block)
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
