"""A large, cached embedding corpus of real code (the standard library plus site-packages).

Embedding 100k chunks takes the better part of an hour on 2 CPU cores, so the work is done in
shards saved as they finish (temp file + rename): an interrupted run resumes where it stopped.
Used by `benchmarks/bench_vector.py` (part b); run it ahead of time with

    nice -n 19 .venv/bin/python -m openglm.retrieval.corpus --out .bench/vector/code --limit 101000 --max-seq-length 32
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

import numpy as np

from openglm.util.files import write_atomic

from .chunking import Chunk, chunk_file, decode_text, iter_source_files

SHARD = 4096


def default_roots() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    return [stdlib, site] if site != stdlib else [stdlib]


def collect_chunks(roots: list[Path], limit: int, seed: int = 0) -> list[Chunk]:
    """Chunks of .py files under the roots: files in a seeded random order until `limit` chunks."""
    files = []
    for root in roots:
        for path in iter_source_files(root, {".py"}):
            if "site-packages" not in path.relative_to(root).parts:  # stdlib root holds site-packages
                files.append((root, path))
    rng = random.Random(seed)
    rng.shuffle(files)
    chunks: list[Chunk] = []
    for root, path in files:
        text = decode_text(path.read_bytes())
        if text is not None:
            chunks += chunk_file(f"{root.name}/{path.relative_to(root).as_posix()}", text)
        if len(chunks) >= limit:
            break
    rng.shuffle(chunks)
    return chunks[:limit]


def build(out: Path, limit: int, max_seq_length: int = 32, roots: list[Path] | None = None) -> int:
    from tqdm import tqdm  # the embedder (torch) loads only when embedding

    from .embedder import Embedder

    out.mkdir(parents=True, exist_ok=True)
    meta = out / "chunks.jsonl"
    if meta.exists():
        rows = [json.loads(line) for line in meta.read_text().splitlines()]
    else:
        chunks = collect_chunks(roots or default_roots(), limit)
        # The name (or path) then the code: with a short max_seq_length the name and signature
        # are what gets embedded, which keeps 100k chunks within reach of 2 CPU cores.
        rows = [{"path": c.path, "start": c.start_line, "end": c.end_line, "kind": c.kind,
                 "name": c.name, "text": f"{c.name or c.path}\n{c.text.strip()}"} for c in chunks]
        write_atomic(meta, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in rows)))
    # One thread: on a shared, oversubscribed machine two OpenMP threads mostly spin-wait.
    emb = Embedder(max_seq_length=max_seq_length, batch_size=64, num_threads=1)
    (out / "embedder.json").write_text(json.dumps(emb.identity.to_dict()))
    n_shards = (len(rows) + SHARD - 1) // SHARD
    for s in tqdm(range(n_shards), desc="embedding shards"):
        path = out / f"emb_{s:04d}.npy"
        if not path.exists():
            vectors = emb.encode([r["text"] for r in rows[s * SHARD:(s + 1) * SHARD]])
            write_atomic(path, lambda p: np.save(p, vectors))
    return len(rows)


def load(out: Path) -> tuple[np.ndarray, list[dict]]:
    """All finished shards (in order) and the metadata rows they cover."""
    rows = [json.loads(line) for line in (out / "chunks.jsonl").read_text().splitlines()]
    shards = []
    for s in range((len(rows) + SHARD - 1) // SHARD):
        path = out / f"emb_{s:04d}.npy"
        if not path.exists():
            break
        shards.append(np.load(path))
    x = np.concatenate(shards) if shards else np.zeros((0, 0), np.float32)
    return x, rows[:len(x)]


def main() -> None:
    ap = argparse.ArgumentParser(description="embed a large real-code corpus for the vector benchmark")
    ap.add_argument("--out", default=".bench/vector/code")
    ap.add_argument("--limit", type=int, default=101_000)
    ap.add_argument("--max-seq-length", type=int, default=32)
    args = ap.parse_args()
    n = build(Path(args.out), args.limit, args.max_seq_length)
    print(f"{n} chunks embedded under {args.out}")


if __name__ == "__main__":
    main()
