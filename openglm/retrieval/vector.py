"""One FAISS-backed vector index whose configuration walks the optimisation ladder.

    flat       exact search over every vector (the baseline)
    ivf        inverted lists: k-means buckets, probe the `nprobe` nearest
    ivfpq      ... with product-quantised codes in the lists (4-bit fast-scan PQ)
    two-level  ... with many more lists, routed by an HNSW graph over the centroids
    prune      IVF-PQ probing, per query, only lists whose centroid distance is within
               `prune_ratio` x the best one (adaptive, `nprobe` is only a cap)
    rerank     ... and re-ranking a shortlist of `rerank` x k candidates exactly

Every stage is a `VectorConfig`; `ladder_config(stage, n, dim)` gives the preset for a data set
of n vectors. FAISS does all the kernels; this module only wires them (the coarse search,
the pruning of probe lists, `search_preassigned`, and the exact re-rank).

Ids are row numbers of the stored float vectors (kept for the exact re-rank and for
retraining); removed rows become tombstones. Internally the metric is always L2: for `ip`
the vectors must be L2-normalised and scores are returned as 1 - d/2 (the cosine).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import faiss
import numpy as np


@dataclass(frozen=True)
class VectorConfig:
    metric: str = "ip"  # ip (normalised vectors, cosine scores) or l2 (squared distances)
    nlist: int = 0  # 0: exact flat index; else number of inverted lists
    coarse: str = "flat"  # flat | hnsw (two-level routing over the centroids)
    hnsw_m: int = 32  # graph degree of the HNSW coarse quantiser
    ef_search: int = 64  # HNSW coarse search breadth at query time (raised to nprobe when smaller)
    pq_dsub: int = 0  # 0: raw vectors in the lists; else dimensions per 4-bit PQ sub-quantiser
    pq_residual: bool = True  # PQ-encode vector - centroid (one look-up table per probed list)
    nprobe: int = 16  # lists probed per query (the cap when pruning)
    prune_ratio: float = 0.0  # 0: fixed nprobe; else keep lists with d <= ratio * d_best
    rerank: int = 0  # 0: none; else exact re-rank of a shortlist of rerank * k candidates
    train_size: int = 0  # vectors used to train k-means / PQ (0: 64 per list, at most 256k)

    def __post_init__(self):
        if self.metric not in ("ip", "l2"):
            raise ValueError(f"VectorConfig.metric must be 'ip' or 'l2', got {self.metric!r}")
        if self.coarse not in ("flat", "hnsw"):
            raise ValueError(f"VectorConfig.coarse must be 'flat' or 'hnsw', got {self.coarse!r}")
        if self.nlist == 0 and (self.pq_dsub or self.prune_ratio or self.coarse != "flat"):
            raise ValueError("VectorConfig: pq_dsub, prune_ratio and coarse='hnsw' need nlist > 0")
        if self.prune_ratio and self.prune_ratio < 1.0:
            raise ValueError(f"VectorConfig.prune_ratio must be 0 or >= 1, got {self.prune_ratio}")

    @classmethod
    def from_dict(cls, d: dict) -> "VectorConfig":
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown VectorConfig field(s) {bad}; known: {sorted(known)}")
        return cls(**d)


STAGES = ["flat", "ivf", "ivfpq", "two-level", "prune", "rerank"]

# The ladder as data: each stage adds one change to the previous. `lists_per_sqrt_n` scales the
# number of inverted lists with the data set (4 sqrt(n) one-level, 8 sqrt(n) two-level).
# Pruning and re-ranking build on the flat-routed IVF-PQ, not on two-level routing: measured on
# 2 cores (docs/retrieval.md), a batched exact coarse search over 4 sqrt(n) centroids is one BLAS
# call and loses no lists, while the HNSW router costs as much per query and misses some; with
# 4-bit residual PQ the per-probe look-up tables, not the centroid search, dominate, so the win
# comes from probing fewer lists (pruning) and re-ranking a short list exactly.
LADDER = {
    "flat": dict(),
    "ivf": dict(lists_per_sqrt_n=4, nprobe=16),
    "ivfpq": dict(lists_per_sqrt_n=4, nprobe=16, pq_dsub=2),
    "two-level": dict(lists_per_sqrt_n=8, nprobe=32, pq_dsub=2, coarse="hnsw"),
    "prune": dict(lists_per_sqrt_n=4, nprobe=16, pq_dsub=2, prune_ratio=1.8),
    "rerank": dict(lists_per_sqrt_n=4, nprobe=16, pq_dsub=2, prune_ratio=1.8, rerank=8),
}


def ladder_config(stage: str, n: int, dim: int, metric: str = "ip", **overrides) -> VectorConfig:
    if stage not in LADDER:
        raise ValueError(f"unknown ladder stage {stage!r}; stages: {STAGES}")
    preset = dict(LADDER[stage])
    factor = preset.pop("lists_per_sqrt_n", 0)
    if factor:
        # Few vectors per list makes k-means and PQ meaningless: keep >= ~39 points per list.
        preset["nlist"] = max(1, min(int(factor * np.sqrt(n)), n // 39))
    if preset.get("pq_dsub") and dim % preset["pq_dsub"]:
        preset["pq_dsub"] = 1
    if preset.get("pq_dsub"):
        # Residual codes pay off when lists are tight clusters far from the origin (SIFT-like l2
        # data: raw PQ recall 0.68 vs 0.34 without). Normalised sentence embeddings are not: the
        # residual is as long as the vector, and one look-up table per query instead of one per
        # probed list was 7.6x faster at the same recall on the code set (docs/retrieval.md).
        preset["pq_residual"] = metric == "l2"
    preset.update(metric=metric, **overrides)
    return VectorConfig(**preset)


class VectorIndex:
    def __init__(self, dim: int, config: VectorConfig | None = None):
        self.dim = dim
        self.config = config or VectorConfig()
        self.vectors = np.zeros((0, dim), dtype=np.float32)  # row i holds the vector of id i
        self.alive = np.zeros(0, dtype=bool)
        self.index = self._make_index()

    # ---- construction -------------------------------------------------------------------
    def _make_index(self) -> faiss.Index:
        c, d = self.config, self.dim
        if c.nlist == 0:
            return faiss.IndexIDMap2(faiss.IndexFlatL2(d))
        quantizer = faiss.IndexHNSWFlat(d, c.hnsw_m) if c.coarse == "hnsw" else faiss.IndexFlatL2(d)
        if c.pq_dsub:
            if d % c.pq_dsub:
                raise ValueError(f"pq_dsub={c.pq_dsub} does not divide the dimension {d}")
            index = faiss.IndexIVFPQFastScan(quantizer, d, c.nlist, d // c.pq_dsub, 4)
            index.by_residual = c.pq_residual
        else:
            index = faiss.IndexIVFFlat(quantizer, d, c.nlist)
        if c.coarse == "hnsw":
            # Train k-means with exact assignment; only the trained centroids go into the graph.
            # (Python must keep a reference: FAISS does not own it.)
            self._clustering_index = faiss.IndexFlatL2(d)
            index.clustering_index = self._clustering_index
        return index

    @property
    def ntotal(self) -> int:
        return int(self.alive.sum())

    def _check(self, x: np.ndarray, what: str) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{what}: expected shape (n, {self.dim}), got {x.shape}")
        if self.config.metric == "ip" and len(x):
            norms = np.linalg.norm(x, axis=1)
            if np.abs(norms - 1).max() > 1e-3:
                raise ValueError(f"{what}: metric 'ip' needs L2-normalised vectors (norms {norms.min():.3f}"
                                 f"..{norms.max():.3f}); normalise them or use metric 'l2'")
        return x

    def train(self, x: np.ndarray, seed: int = 0, centroids: np.ndarray | None = None) -> None:
        """k-means the lists (unless `centroids` from another index are given) and train the PQ."""
        x = self._check(x, "train")
        c = self.config
        if self.index.is_trained or c.nlist == 0:
            return
        if len(x) < c.nlist:
            raise ValueError(f"cannot train {c.nlist} lists on {len(x)} vectors")
        if centroids is not None:
            if centroids.shape != (c.nlist, self.dim):
                raise ValueError(f"centroids: expected shape ({c.nlist}, {self.dim}), got {centroids.shape}")
            self.index.quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
            self.index.quantizer.is_trained = True
        size = c.train_size or min(len(x), 64 * c.nlist, 256 * 1024)
        if c.coarse == "hnsw":  # PQ training computes residuals against graph-searched centroids
            faiss.downcast_index(self.index.quantizer).hnsw.efSearch = 128
        if size < len(x):
            x = x[np.random.default_rng(seed).choice(len(x), size, replace=False)]
        self.index.train(x)

    def centroids(self) -> np.ndarray:
        """The list centroids (to share one k-means between ladder stages)."""
        q = self.index.quantizer
        return q.reconstruct_n(0, q.ntotal)

    def add(self, x: np.ndarray) -> np.ndarray:
        """Add vectors (training the index first if needed); returns their ids."""
        x = self._check(x, "add")
        if not self.index.is_trained:
            self.train(np.concatenate([self.vectors[self.alive], x]))
        ids = np.arange(len(self.vectors), len(self.vectors) + len(x), dtype=np.int64)
        if self.config.coarse == "hnsw":
            # Assignment to lists goes through the graph: too narrow a search files vectors
            # into lists that are not their nearest, and recall drops for good.
            faiss.downcast_index(self.index.quantizer).hnsw.efSearch = 128
        self.index.add_with_ids(x, ids)
        self.vectors = np.concatenate([self.vectors, x])
        self.alive = np.concatenate([self.alive, np.ones(len(x), dtype=bool)])
        return ids

    def remove(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        if ids.min() < 0 or ids.max() >= len(self.alive):
            raise KeyError(f"remove: ids out of range 0..{len(self.alive) - 1}")
        self.alive[ids] = False
        self.index.remove_ids(ids)
        self.vectors[ids] = 0.0

    # ---- search -------------------------------------------------------------------------
    def set_search(self, **params) -> None:
        """Change search-time parameters (nprobe, prune_ratio, rerank, ef_search) in place."""
        allowed = {"nprobe", "prune_ratio", "rerank", "ef_search"}
        bad = sorted(set(params) - allowed)
        if bad:
            raise ValueError(f"set_search: {bad} are build-time parameters; search-time ones: {sorted(allowed)}")
        self.config = replace(self.config, **params)

    def search(self, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (nq, k); ids -1 where fewer than k were found. Scores: cosine for
        'ip' (higher is better), squared L2 distance for 'l2' (lower is better)."""
        xq = self._check(xq, "search")
        c = self.config
        if c.nlist == 0:
            d, i = self.index.search(xq, k)
        else:
            shortlist = k * c.rerank if c.rerank else k
            d, i = self._search_ivf(xq, shortlist)
            if c.rerank:
                d, i = self._rerank(xq, i, k)
        return self._to_scores(d, i), i

    def _search_ivf(self, xq: np.ndarray, k: int):
        c = self.config
        nprobe = min(c.nprobe, c.nlist)
        quantizer = faiss.downcast_index(self.index.quantizer)
        if c.coarse == "hnsw":
            quantizer.hnsw.efSearch = max(c.ef_search, nprobe)
        self.index.nprobe = nprobe  # search_preassigned reads exactly nprobe columns
        dq, iq = quantizer.search(xq, nprobe)
        if c.prune_ratio:
            # Early pruning: a list whose centroid is much farther than the nearest one rarely
            # holds a top-k neighbour; -1 tells FAISS to skip that probe.
            limit = c.prune_ratio * np.maximum(dq[:, :1], 1e-12)
            iq = np.where(dq <= limit, iq, -1)
        return self.index.search_preassigned(xq, k, iq, dq)

    def _rerank(self, xq: np.ndarray, cand: np.ndarray, k: int):
        """Exact squared L2 on the shortlist (FAISS's by-index kernel); missing candidates rank last."""
        missing = cand < 0
        ids = np.where(missing, 0, cand)
        dist = np.empty(cand.shape, dtype=np.float32)
        faiss.fvec_L2sqr_by_idx(faiss.swig_ptr(dist), faiss.swig_ptr(xq), faiss.swig_ptr(self.vectors),
                                faiss.swig_ptr(ids), self.dim, len(xq), cand.shape[1])
        dist[missing] = np.inf
        k_eff = min(k, cand.shape[1])
        top = np.argpartition(dist, k_eff - 1, axis=1)[:, :k_eff]
        top_d = np.take_along_axis(dist, top, axis=1)
        order = np.argsort(top_d, axis=1, kind="stable")
        out_i = np.take_along_axis(np.take_along_axis(cand, top, axis=1), order, axis=1)
        out_d = np.take_along_axis(top_d, order, axis=1)
        if k_eff < k:
            out_i = np.pad(out_i, ((0, 0), (0, k - k_eff)), constant_values=-1)
            out_d = np.pad(out_d, ((0, 0), (0, k - k_eff)), constant_values=np.inf)
        return out_d, np.where(np.isinf(out_d), -1, out_i)

    def _to_scores(self, d: np.ndarray, i: np.ndarray) -> np.ndarray:
        if self.config.metric == "ip":
            return np.where(i >= 0, 1.0 - d / 2.0, -np.inf).astype(np.float32)
        return np.where(i >= 0, d, np.inf).astype(np.float32)

    # ---- persistence --------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / "vectors.faiss", lambda p: faiss.write_index(self.index, str(p)))
        write_atomic(directory / "vectors.npy", lambda p: np.save(p, self.vectors))
        write_atomic(directory / "alive.npy", lambda p: np.save(p, self.alive))
        meta = {"dim": self.dim, "config": asdict(self.config)}
        write_atomic(directory / "vectors.json", lambda p: p.write_text(json.dumps(meta, indent=1)))

    @classmethod
    def load(cls, directory: str | Path) -> "VectorIndex":
        directory = Path(directory)
        meta_path = directory / "vectors.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"no vector index at {directory} (missing {meta_path.name})")
        meta = json.loads(meta_path.read_text())
        self = cls.__new__(cls)
        self.dim, self.config = meta["dim"], VectorConfig.from_dict(meta["config"])
        self.index = faiss.read_index(str(directory / "vectors.faiss"))
        self.vectors = np.load(directory / "vectors.npy")
        self.alive = np.load(directory / "alive.npy")
        if self.index.ntotal != self.alive.sum():
            raise ValueError(f"vector index at {directory} is inconsistent: FAISS holds {self.index.ntotal} "
                             f"vectors, the store {int(self.alive.sum())}")
        return self


def write_atomic(path: Path, write) -> None:
    """`write(tmp)` then rename over `path`: readers never see a half-written file."""
    tmp = path.with_name(path.name + ".tmp" + path.suffix)
    write(tmp)
    os.replace(tmp, path)
