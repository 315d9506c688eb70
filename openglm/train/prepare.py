"""Everything a run needs before its first step: output folder, tokenizer, token streams, model config."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from openglm.model.config import ModelConfig
from openglm.model.errors import CheckpointError
from openglm.tokenizer import SOP, Tokenizer, train_tokenizer
from openglm.train import dist
from openglm.train.config import RESUME_MUST_MATCH, TrainConfig
from openglm.train.data import load_documents, split_documents, tokenize_documents

# config.json keys written by save_pretrained that describe the file, not the model (the special-token ids describe
# the tokenizer, which a resumed run reads from its own folder; runs saved before they were written had the preset's).
_CONFIG_META_KEYS = {"architectures", "torch_dtype", "dtype", "transformers_version", "model_type", "auto_map",
                     "bos_token_id", "eos_token_id", "pad_token_id"}


class TrainSetupError(ValueError):
    """The run cannot start: bad output folder, mismatched resume, inconsistent sizes."""


def prepare_output(out_dir: str | os.PathLike) -> Path:
    """Create the output folder and prove it is writable, before any expensive work."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainSetupError(f"output folder {out} is not writable: {e.strerror or e}") from None
    return out


def prepare_tokens(cfg: TrainConfig, out: Path, info: dist.DistInfo, tokenizer=None, log=print):
    """Tokenizer plus (train, val) int32 token streams for cfg.data.

    The tokenizer is, in order: the one passed in, cfg.tokenizer, the run folder's `tokenizer/` (so a
    resumed run keeps its vocabulary), or a new byte-level BPE trained on the training split.
    """
    docs = load_documents(cfg.data)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    tok_dir = out / "tokenizer"
    if tokenizer is None and cfg.tokenizer:
        tokenizer = Tokenizer.from_checkpoint(cfg.tokenizer)
    if tokenizer is None and not (tok_dir / "tokenizer.json").is_file():
        if info.is_main:
            vocab = cfg.vocab_size or _preset_vocab(cfg)
            log(f"training a {vocab}-token byte-level BPE on {len(train_docs)} documents ...")
            train_tokenizer((d.text for d in train_docs), vocab, out_dir=tok_dir)
        dist.barrier(info)
    if tokenizer is None:
        tokenizer = Tokenizer.from_checkpoint(tok_dir)
        if cfg.vocab_size and tokenizer.vocab_size != cfg.vocab_size:
            raise TrainSetupError(f"{tok_dir} holds a {tokenizer.vocab_size}-token tokenizer from an earlier run, but "
                                  f"vocab_size={cfg.vocab_size} was asked for: use another output folder")
    elif info.is_main and not (tok_dir / "tokenizer.json").is_file():
        tokenizer.save(tok_dir)
    show = cfg.progress and info.is_main
    train_tokens = tokenize_documents(train_docs, tokenizer, progress=show)
    val_tokens = tokenize_documents(val_docs, tokenizer, progress=show)
    log(f"data {cfg.data!r}: {len(train_docs)} train / {len(val_docs)} val documents, "
        f"{len(train_tokens):,} / {len(val_tokens):,} tokens")
    return tokenizer, train_tokens, val_tokens


def split_stream(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Given one pre-tokenized stream and no validation stream: its tail is the validation split."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def _preset_vocab(cfg: TrainConfig) -> int:
    return int(cfg.model_overrides.get("vocab_size") or ModelConfig.from_preset(cfg.preset).vocab_size)


def build_model_config(cfg: TrainConfig, tokenizer: Tokenizer | None):
    """The preset with the overrides; unless overridden, the embedding is sized to the tokenizer and config.json
    gets the tokenizer's eos, pad and bos ids (engines that read config.json, vLLM and transformers' generate,
    stop at its eos: the preset's ids are another tokenizer's)."""
    overrides = dict(cfg.model_overrides)
    if tokenizer is not None:
        for key, value in {"vocab_size": tokenizer.vocab_size, **special_token_ids(tokenizer)}.items():
            overrides.setdefault(key, value)
    return ModelConfig.from_preset(cfg.preset, **overrides)


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """config.json's eos/pad/bos ids of a tokenizer (those it has: GLM's bos is <sop>, after [gMASK])."""
    ids = {"pad_token_id": tokenizer.pad_id}
    if tokenizer.eos_ids:
        ids["eos_token_id"] = tokenizer.eos_ids[0]
    sop = tokenizer.hf.token_to_id(SOP)
    if sop is not None:
        ids["bos_token_id"] = sop
    return ids


def check_vocab(model_config, tokenizer, max_token: int) -> None:
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise TrainSetupError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                              f"{model_config.vocab_size}")
    if max_token >= model_config.vocab_size:
        raise TrainSetupError(f"the data holds token id {max_token} >= model vocab_size {model_config.vocab_size}")


def check_resume_compatible(ckpt: Path, model_config, cfg: TrainConfig, saved_cfg: dict) -> None:
    """Refuse to resume a checkpoint whose model or data recipe differs, naming the fields."""
    saved = json.loads((ckpt / "config.json").read_text())
    current = model_config.to_hf_dict()
    diffs = [f"{k}: checkpoint {saved[k]!r} vs now {current[k]!r}"
             for k in sorted(set(saved) & set(current) - _CONFIG_META_KEYS) if saved[k] != current[k]]
    diffs += [f"train.{k}: checkpoint {saved_cfg.get(k)!r} vs now {getattr(cfg, k)!r}"
              for k in RESUME_MUST_MATCH if saved_cfg.get(k) != getattr(cfg, k)]
    if diffs:
        raise CheckpointError(f"cannot resume from {ckpt}: the run's config differs:\n  " + "\n  ".join(diffs))


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
