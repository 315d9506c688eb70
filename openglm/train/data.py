"""Training data: find a corpus, split it by file, tokenize it, and pack it into batches.

A corpus is one of
- `stdlib`: the Python standard library source of the running interpreter (real code, on every machine);
- a folder: every UTF-8 text file under it (hidden folders and binary files skipped);
- a `.jsonl` file: one document per line, taken from its `text` field.
Train/validation are split by document name (a hash), so the split is deterministic and a file never
straddles both sides.
"""

from __future__ import annotations

import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Parts of the stdlib that are not representative code (tests, GUI demos, generated tables).
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo",
               "ensurepip", "lib2to3", "__pycache__", "pydoc_data", "encodings"}
TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts",
                 ".java", ".go", ".rs", ".sh", ".toml", ".yaml", ".yml", ".json", ".cfg", ".ini", ".html",
                 ".css", ".sql", ".rb", ".lua", ".jl", ".kt", ".swift", ".scala", ""}
MAX_FILE_BYTES = 2_000_000


class CorpusError(ValueError):
    """The corpus is missing, empty or malformed."""


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier (relative path, or file:line for JSONL): decides the split
    text: str


def load_documents(source: str) -> list[Document]:
    """Read the documents of `source` ("stdlib", a folder, or a .jsonl file), sorted by name."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = _read_folder(root, suffixes={".py"}, skip=STDLIB_SKIP)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise CorpusError(f"corpus {source!r} does not exist (give 'stdlib', a folder, or a .jsonl file)")
        if path.is_dir():
            docs = _read_folder(path, suffixes=TEXT_SUFFIXES, skip={"__pycache__", "node_modules"})
        elif path.suffix == ".jsonl":
            docs = _read_jsonl(path)
        else:
            docs = [Document(path.name, _read_text(path) or "")]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise CorpusError(f"corpus {source!r} is empty: no non-empty text documents found")
    return sorted(docs, key=lambda d: d.name)


def _read_folder(root: Path, suffixes: set[str], skip: set[str]) -> list[Document]:
    docs = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in skip or part.startswith(".") for part in rel.parts[:-1]) or rel.name.startswith("."):
            continue
        if not path.is_file() or path.suffix not in suffixes or path.stat().st_size > MAX_FILE_BYTES:
            continue
        text = _read_text(path)
        if text is not None:
            docs.append(Document(rel.as_posix(), text))
    return docs


def _read_text(path: Path) -> str | None:
    """The file's text, or None for binary / non-UTF-8 files."""
    data = path.read_bytes()
    if b"\x00" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CorpusError(f"{path}:{lineno}: each line needs a string field 'text'")
            docs.append(Document(f"{path.name}:{lineno:09d}", record["text"]))
    return docs


def split_documents(docs: list[Document], val_fraction: float = 0.05) -> tuple[list[Document], list[Document]]:
    """Deterministic split by a hash of the document name; both sides get at least one document."""
    if len(docs) < 2:
        raise CorpusError(f"need at least 2 documents to split train/validation, got {len(docs)}")
    keyed = sorted(docs, key=lambda d: zlib.crc32(d.name.encode()))
    n_val = min(max(1, round(len(docs) * val_fraction)), len(docs) - 1)
    val = sorted(keyed[:n_val], key=lambda d: d.name)
    train = sorted(keyed[n_val:], key=lambda d: d.name)
    return train, val


def tokenize_documents(docs: list[Document], tokenizer, progress: bool = False) -> np.ndarray:
    """One flat int32 token stream: every document followed by eos."""
    from tqdm import tqdm  # only for a progress bar

    eos = tokenizer.eos_id
    parts, chunk = [], 64
    for i in tqdm(range(0, len(docs), chunk), desc="tokenize", unit="chunk", disable=not progress, leave=False):
        for ids in tokenizer.encode_batch([d.text for d in docs[i:i + chunk]]):
            parts.append(np.asarray(ids + [eos], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


class PackedBatcher:
    """Cuts a token stream into windows of seq_len+1 tokens and serves them in a shuffled order.

    Windows are non-overlapping (stride seq_len), reshuffled each epoch from (seed, epoch), so the
    data position is just (epoch, cursor): `state_dict()` / `load_state_dict()` make resume exact.
    Every step takes `global_batch` windows; under data parallelism rank r uses its contiguous share,
    so N ranks see exactly the windows one process would see with N accumulation micro-steps.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise CorpusError(f"corpus too small: {len(tokens)} tokens cannot fill one sequence of {seq_len + 1}")
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def next_indices(self, n: int) -> np.ndarray:
        out = []
        while len(out) < n:
            if self.cursor == self.n_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), self.n_windows - self.cursor)
            out.extend(self._order[self.cursor:self.cursor + take].tolist())
            self.cursor += take
        return np.asarray(out)

    def next_batch(self, global_batch: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """This rank's share of the next global batch: int64 array [global_batch // world, seq_len + 1]."""
        idx = self.next_indices(global_batch)
        share = global_batch // world
        mine = idx[rank * share:(rank + 1) * share]
        return np.stack([self.window(i) for i in mine]).astype(np.int64)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "seq_len": self.seq_len,
                "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "n_windows"):
            if state[key] != getattr(self, key):
                raise CorpusError(f"cannot resume the data position: {key} was {state[key]}, "
                                  f"now {getattr(self, key)} (different corpus, tokenizer or seq_len)")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """A fixed set of validation windows spread evenly over the stream: [n, seq_len + 1] int64."""
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise CorpusError(f"validation split too small: {len(tokens)} tokens < one sequence of {seq_len + 1}")
    picks = np.linspace(0, n - 1, num=min(n, max_windows)).round().astype(int)
    return np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in picks]).astype(np.int64)


def unigram_loss(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of val under the train unigram distribution (add-one smoothed)."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val_tokens].mean())
