"""A random-weight checkpoint with a real tokenizer, for tests, benchmarks and smoke runs.

The tokenizer is a byte-level BPE trained in about a second on a few Python standard-library
sources (always present, no download); the model is a preset with random weights whose vocabulary
matches the tokenizer. The text it generates is gibberish, but every code path is the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

STDLIB_FILES = ("os.py", "json/__init__.py", "json/decoder.py", "textwrap.py", "string.py", "queue.py")


def stdlib_texts(limit_chars: int = 200_000) -> list[str]:
    root = Path(os.__file__).parent
    texts, total = [], 0
    for name in STDLIB_FILES:
        f = root / name
        if f.is_file() and total < limit_chars:
            text = f.read_text(encoding="utf-8", errors="replace")
            texts.extend(text.splitlines(keepends=True))
            total += len(text)
    return texts


def build_random_checkpoint(path: str | Path, preset: str = "tiny", vocab_size: int = 384, seed: int = 0,
                            texts: list[str] | None = None, **overrides) -> Path:
    """Write config.json + safetensors + tokenizer files to `path`; returns the path. The tokenizer is
    trained on `texts` (default: a few stdlib sources)."""
    import torch  # heavy: loaded when a checkpoint is built

    from openglm.model import ModelConfig, build_model, save_pretrained
    from openglm.tokenizer import train_tokenizer

    path = Path(path)
    tok = train_tokenizer(texts if texts is not None else stdlib_texts(), vocab_size)
    cfg = ModelConfig.from_preset(preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                                  pad_token_id=tok.pad_id, bos_token_id=tok.bos_ids[-1], **overrides)
    torch.manual_seed(seed)
    model = build_model(cfg)  # the preset's family: GlmMoeDsaForCausalLM, or glm5_next's subclass
    save_pretrained(model, path, tokenizer=tok)
    return path
