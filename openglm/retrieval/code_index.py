"""The code knowledge base: chunks + embeddings + BM25 of one repository, on disk, updatable.

    from openglm.retrieval import CodeIndex
    CodeIndex.build("path/to/repo")                       # or update: only changed files re-embed
    hits = CodeIndex.open("path/to/repo").search("parse a JSON number", k=5)
    for h in hits: print(h.location, h.name, h.score)      # e.g. json/scanner.py:21-68 py_make_scanner

Layout of the index directory (default `<repo>/.openglm-index`): `manifest.json` (embedder
identity, files and their content hashes and chunk ids), `chunks.jsonl`, `vectors.*` (the FAISS
ladder index, see vector.py). Every file is written to a temp name and renamed; the manifest
is written last, so an interrupted build leaves the previous index readable.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from openglm.util.files import write_atomic

from .chunking import Chunk, chunk_file, content_hash, decode_text, iter_source_files, printable_path
from .embedder import Embedder, EmbedderIdentity, check_identity
from .lexical import BM25Index, code_share, reciprocal_rank_fusion
from .vector import VectorConfig, VectorIndex, ladder_config
from .warm import INDEX_DIRNAME, index_dir_of, search_warm

FORMAT_VERSION = 1
EXACT_UP_TO = 50_000  # below this many chunks exact search is fast enough and loses nothing
MODES = ("hybrid", "dense", "bm25")
# Hybrid fusion: weighted reciprocal rank fusion, the weights (dense, bm25) set by the query. A question in
# words is answered best with the dense ranking leading (a single word shared with an unrelated function
# must not outrank the meaning); an identifier-heavy one (a traceback, a test report, a name) with BM25
# leading. The weights move from NATURAL to CODE with the query's code_share, reaching CODE at
# CODE_SHARE_FULL; RRF_C is the fusion's rank offset. Tuned on benchmarks/bench_retrieval_quality.py
# (docs/retrieval.md has the sweep).
FUSION_NATURAL = (1.0, 0.5)
FUSION_CODE = (0.1, 1.0)
CODE_SHARE_FULL = 0.5
RRF_C = 10.0


@dataclass(frozen=True)
class Hit(Chunk):
    """A chunk a search found, with its score (higher is better)."""

    score: float

    def to_dict(self) -> dict:
        return {**asdict(self), "location": self.location}

    @classmethod
    def from_dict(cls, d: dict) -> "Hit":
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass
class UpdateStats:
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    chunks_embedded: int = 0
    total_chunks: int = 0
    skipped: list[str] = field(default_factory=list)  # "path: why" for files that could not be indexed


class CodeIndex:
    def __init__(self, index_dir: Path, repo: Path, manifest: dict, chunks: dict[int, Chunk],
                 vectors: VectorIndex | None, embedder: Embedder | None):
        self.index_dir, self.repo, self.manifest = index_dir, repo, manifest
        self.chunks, self.vectors, self._embedder = chunks, vectors, embedder
        self._bm25: tuple[BM25Index, list[int]] | None = None

    # ---- opening and building -----------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, embedder: Embedder | None = None) -> "CodeIndex":
        """Open an index directory, or the default index of a repository."""
        index_dir = index_dir_of(path)
        manifest_path = index_dir / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"{manifest_path}: index format {manifest.get('version')}, expected {FORMAT_VERSION}")
        if embedder is not None:
            check_identity(manifest["embedder"], embedder.identity, str(index_dir))
        chunks = {}
        for line in (index_dir / "chunks.jsonl").read_text().splitlines():
            row = json.loads(line)
            cid = row.pop("id")
            chunks[cid] = Chunk(**row)
        vectors = VectorIndex.load(index_dir) if chunks else None
        return cls(index_dir, Path(manifest["repo"]), manifest, chunks, vectors, embedder)

    @classmethod
    def build(cls, repo: str | Path, index_dir: str | Path | None = None, embedder: Embedder | None = None,
              model_path: str | Path | None = None, progress: bool = False) -> tuple["CodeIndex", UpdateStats]:
        """Create the index of `repo`, or bring an existing one up to date (incrementally)."""
        repo = Path(repo).resolve()
        if not repo.is_dir():
            raise FileNotFoundError(f"repository path {repo} does not exist or is not a directory")
        index_dir = Path(index_dir) if index_dir else repo / INDEX_DIRNAME
        if (index_dir / "manifest.json").exists():
            index = cls.open(index_dir, embedder)
            if index.repo != repo:
                raise ValueError(f"index {index_dir} belongs to {index.repo}, not {repo}")
        else:
            embedder = embedder or Embedder(model_path)
            manifest = {"version": FORMAT_VERSION, "repo": str(repo), "model_path": str(embedder.model_path),
                        "embedder": embedder.identity.to_dict(), "files": {}}
            index = cls(index_dir, repo, manifest, {}, None, embedder)
        return index, index.update(progress=progress)

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            ident = EmbedderIdentity.from_dict(self.manifest["embedder"])
            self._embedder = Embedder(self.manifest["model_path"], max_seq_length=ident.max_seq_length)
            check_identity(ident, self._embedder.identity, str(self.index_dir))
        return self._embedder

    # ---- incremental update -------------------------------------------------------------
    def _scan(self, skipped: list[str]) -> dict[str, tuple[str, str]]:
        """rel path -> (content hash, text) of every indexable file in the repository."""
        found = {}
        index_dir = self.index_dir.resolve()
        for path in iter_source_files(self.repo, skipped=skipped):
            if index_dir in path.resolve().parents:
                continue
            try:
                data = path.read_bytes()
            except OSError as e:  # unreadable (permissions), vanished: one file does not stop the build
                skipped.append(f"{printable_path(path.relative_to(self.repo))}: cannot read ({e.strerror or e})")
                continue
            text = decode_text(data)
            if text is not None and text.strip():
                found[path.relative_to(self.repo).as_posix()] = (content_hash(data), text)
        return found

    def update(self, progress: bool = False) -> UpdateStats:
        skipped: list[str] = []
        found = self._scan(skipped)
        if not found:
            raise ValueError(f"repository {self.repo} has no indexable text files "
                             f"(looked for .py, .md, .txt, ... outside hidden and build folders)")
        files, stats = self.manifest["files"], UpdateStats(skipped=skipped)
        stale: list[int] = []
        for rel in sorted(set(files) - set(found)):
            stats.removed.append(rel)
            stale += files.pop(rel)["chunk_ids"]
        new_chunks: list[Chunk] = []
        owners: list[str] = []
        for rel, (digest, text) in sorted(found.items()):
            if rel in files and files[rel]["hash"] == digest:
                stats.unchanged += 1
                continue
            (stats.changed if rel in files else stats.added).append(rel)
            if rel in files:
                stale += files[rel]["chunk_ids"]
            file_chunks = chunk_file(rel, text)
            files[rel] = {"hash": digest, "chunk_ids": []}
            new_chunks += file_chunks
            owners += [rel] * len(file_chunks)
        if not stale and not new_chunks and self.vectors is not None:
            stats.total_chunks = len(self.chunks)
            return stats
        for cid in stale:
            self.chunks.pop(cid, None)
        emb = self.embedder.encode([c.embed_text() for c in new_chunks], progress=progress)
        self._update_vectors(stale, new_chunks, owners, emb)
        stats.chunks_embedded, stats.total_chunks = len(new_chunks), len(self.chunks)
        self._bm25 = None
        self.save()
        return stats

    def _update_vectors(self, stale: list[int], new_chunks, owners, emb: np.ndarray) -> None:
        n_after = len(self.chunks) + len(new_chunks)
        config = self._config_for(n_after, emb.shape[1])
        if self.vectors is None or self.vectors.config.nlist != config.nlist:
            # First build, or the repository crossed the exact-search size: re-index everything
            # from the stored vectors (nothing is re-embedded).
            keep = sorted(self.chunks)
            old = self.vectors.vectors[keep] if keep else np.zeros((0, emb.shape[1]), np.float32)
            old_chunks = [self.chunks[i] for i in keep]
            self.vectors = VectorIndex(emb.shape[1], config)
            ids = self.vectors.add(np.concatenate([old, emb])) if n_after else []
            self.chunks = dict(zip(map(int, ids), old_chunks + list(new_chunks)))
            for rel in self.manifest["files"]:
                self.manifest["files"][rel]["chunk_ids"] = []
            for cid, chunk in self.chunks.items():
                self.manifest["files"][chunk.path]["chunk_ids"].append(cid)
            return
        self.vectors.remove(stale)
        ids = self.vectors.add(emb) if len(emb) else []
        for cid, chunk, rel in zip(map(int, ids), new_chunks, owners):
            self.chunks[cid] = chunk
            self.manifest["files"][rel]["chunk_ids"].append(cid)

    @staticmethod
    def _config_for(n: int, dim: int) -> VectorConfig:
        if n <= EXACT_UP_TO:
            return VectorConfig(metric="ip")
        # Search settings from 100k real code-chunk embeddings (bench_vector, part b: recall@10 0.951
        # was reached with rerank=4, and with rerank=2 without pruning); re-ranking 8k candidates
        # instead buys margin for other repositories.
        return ladder_config("rerank", n, dim, metric="ip", nprobe=64, prune_ratio=2.5, rerank=8)

    def save(self) -> None:
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self.vectors.save(self.index_dir)
        rows = "".join(json.dumps({"id": cid, **asdict(c)}) + "\n" for cid, c in sorted(self.chunks.items()))
        write_atomic(self.index_dir / "chunks.jsonl", lambda p: p.write_text(rows))
        manifest = json.dumps(self.manifest, indent=1)
        write_atomic(self.index_dir / "manifest.json", lambda p: p.write_text(manifest))

    # ---- search -------------------------------------------------------------------------
    def search(self, query: str, k: int = 10, mode: str = "hybrid") -> list[Hit]:
        """The k best chunks for a natural-language or identifier query."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a whole number >= 1, got {k!r}")
        if mode not in MODES:
            raise ValueError(f"unknown search mode {mode!r}; modes: {MODES}")
        if not query.strip():
            raise ValueError("empty query")
        if mode == "dense":
            ranked = self._dense(query, k)
        elif mode == "bm25":
            ranked = self._lexical(query, k)
        else:  # fuse two deeper candidate pools
            pool = max(k * 5, 50)
            dense, lexical = self._dense(query, pool), self._lexical(query, pool)
            ranked = fuse(query, dense, lexical, k)
        return [Hit(**asdict(self.chunks[cid]), score=float(s)) for cid, s in ranked[:k]]

    def _dense(self, query: str, k: int) -> list[tuple[int, float]]:
        q = self.embedder.encode([query])
        scores, ids = self.vectors.search(q, min(k, self.vectors.ntotal))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def _lexical(self, query: str, k: int) -> list[tuple[int, float]]:
        if self._bm25 is None:
            order = sorted(self.chunks)
            self._bm25 = (_bm25_of([self.chunks[i] for i in order]), order)
        bm25, order = self._bm25
        scores, rows = bm25.search(query, k)
        return [(order[r], float(s)) for r, s in zip(rows, scores)]


def fusion_weights(query: str) -> tuple[float, float]:
    """(dense, bm25) weights of the hybrid fusion for this query: FUSION_NATURAL for words, FUSION_CODE for code."""
    t = min(1.0, code_share(query) / CODE_SHARE_FULL)
    return tuple(a + t * (b - a) for a, b in zip(FUSION_NATURAL, FUSION_CODE))


def fuse(query: str, dense: list[tuple[int, float]], lexical: list[tuple[int, float]], k: int,
         weights: tuple[float, float] | None = None, c: float = RRF_C) -> list[tuple[int, float]]:
    """The hybrid ranking of two (id, score) rankings, best first."""
    return reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]], k, c=c,
                                  weights=weights or fusion_weights(query))


def search_repository(repo: str | Path, query: str, k: int = 10, mode: str = "hybrid") -> tuple[list[Hit], str]:
    """Search a repository for the agent: through its code index when it has one
    (`openglm index build REPO`), else BM25 over chunks made on the fly (nothing is embedded, so
    this stays fast on any checkout). Returns (hits, how: the mode used, or "bm25-live")."""
    repo = Path(repo)
    if not repo.is_dir():
        raise FileNotFoundError(f"repository path {repo} does not exist or is not a directory")
    if (repo / INDEX_DIRNAME / "manifest.json").exists():
        warm = search_warm(repo / INDEX_DIRNAME, query, k, mode)  # `openglm index serve`: no model load here
        if warm is not None:
            return [Hit.from_dict(h) for h in warm], mode
        return CodeIndex.open(repo).search(query, k, mode=mode), mode
    if not query.strip():
        raise ValueError("empty query")
    chunks = [c for path in iter_source_files(repo)
              for c in _chunks_of(repo, path)]
    if not chunks:
        raise ValueError(f"repository {repo} has no indexable text files")
    scores, rows = _bm25_of(chunks).search(query, k)
    return [Hit(**asdict(chunks[r]), score=float(s)) for r, s in zip(rows, scores)], "bm25-live"


def _bm25_of(chunks: list[Chunk]) -> BM25Index:
    """BM25 over the chunks' code, with path and qualified name as the boosted name field."""
    return BM25Index([c.text for c in chunks], [f"{c.path} {c.name}" for c in chunks])


def _chunks_of(repo: Path, path: Path) -> list[Chunk]:
    text = decode_text(path.read_bytes())
    return chunk_file(path.relative_to(repo).as_posix(), text) if text and text.strip() else []
