"""One FAISS-backed vector index whose configuration walks the optimisation ladder.

    flat       exact search over every vector (the baseline)
    ivf        inverted lists: k-means buckets, probe the `nprobe` nearest
    ivfpq      ... with quantised codes in the lists: 4-bit fast-scan product quantisation
               (`pq_dsub`) or 8-bit scalar quantisation (`sq_bits`); the preset picks by metric
    two-level  ... with many more lists, routed by an HNSW graph over the centroids
    prune      quantised-code probing, per query, only lists whose centroid distance is within
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from openglm.util.files import write_atomic
from openglm.util.strict import check_keys


@dataclass(frozen=True)
class VectorConfig:
    metric: str = "ip"  # ip (normalised vectors, cosine scores) or l2 (squared distances)
    nlist: int = 0  # 0: exact flat index; else number of inverted lists
    coarse: str = "flat"  # flat | hnsw (two-level routing over the centroids)
    hnsw_m: int = 32  # graph degree of the HNSW coarse quantiser
    ef_search: int = 64  # HNSW coarse search breadth at query time (raised to nprobe when smaller)
    pq_dsub: int = 0  # 0: raw vectors in the lists; else dimensions per 4-bit PQ sub-quantiser
    pq_residual: bool = True  # PQ-encode vector - centroid (one look-up table per probed list)
    sq_bits: int = 0  # 0: no scalar codes; 8: 8-bit scalar-quantised vectors in the lists (see SQ8)
    nprobe: int = 16  # lists probed per query (the cap when pruning)
    prune_ratio: float = 0.0  # 0: fixed nprobe; else keep lists with d <= ratio * d_best
    rerank: int = 0  # 0: none; else exact re-rank of a shortlist of rerank * k candidates
    train_size: int = 0  # vectors used to train k-means / PQ (0: 64 per list, at most 256k)

    def __post_init__(self):
        if self.metric not in ("ip", "l2"):
            raise ValueError(f"VectorConfig.metric must be 'ip' or 'l2', got {self.metric!r}")
        if self.coarse not in ("flat", "hnsw"):
            raise ValueError(f"VectorConfig.coarse must be 'flat' or 'hnsw', got {self.coarse!r}")
        if self.nlist == 0 and (self.pq_dsub or self.sq_bits or self.prune_ratio or self.coarse != "flat"):
            raise ValueError("VectorConfig: pq_dsub, sq_bits, prune_ratio and coarse='hnsw' need nlist > 0")
        if self.sq_bits not in (0, 8):
            raise ValueError(f"VectorConfig.sq_bits must be 0 or 8, got {self.sq_bits}")
        if self.sq_bits and self.pq_dsub:
            raise ValueError("VectorConfig: choose one kind of codes, pq_dsub or sq_bits")
        if self.prune_ratio and self.prune_ratio < 1.0:
            raise ValueError(f"VectorConfig.prune_ratio must be 0 or >= 1, got {self.prune_ratio}")

    @classmethod
    def from_dict(cls, d: dict) -> "VectorConfig":
        check_keys(d, cls, "VectorConfig field(s)")
        return cls(**d)


STAGES = ["flat", "ivf", "ivfpq", "two-level", "prune", "rerank"]

# The ladder as data: each stage adds one change to the previous. `lists_per_sqrt_n` scales the
# number of inverted lists with the data set (4 sqrt(n) one-level, 8 sqrt(n) two-level);
# `codes="quantised"` is resolved by `ladder_config` (4-bit PQ or 8-bit SQ, see there).
# Pruning and re-ranking build on the flat-routed quantised index, not on two-level routing:
# measured on 2 cores (docs/retrieval.md), a batched exact coarse search over 4 sqrt(n) centroids
# is one BLAS call and loses no lists, while the HNSW router misses some lists and, over 8 sqrt(n)
# lists, was slower at equal recall; the win comes from probing fewer lists (pruning) and
# re-ranking a short list exactly.
LADDER = {
    "flat": dict(),
    "ivf": dict(lists_per_sqrt_n=4, nprobe=16),
    "ivfpq": dict(lists_per_sqrt_n=4, nprobe=16, codes="quantised"),
    "two-level": dict(lists_per_sqrt_n=8, nprobe=32, codes="quantised", coarse="hnsw"),
    "prune": dict(lists_per_sqrt_n=4, nprobe=16, codes="quantised", prune_ratio=1.8),
    "rerank": dict(lists_per_sqrt_n=4, nprobe=16, codes="quantised", prune_ratio=1.8, rerank=4),
}


def ladder_config(stage: str, n: int, dim: int, metric: str = "ip", **overrides) -> VectorConfig:
    if stage not in LADDER:
        raise ValueError(f"unknown ladder stage {stage!r}; stages: {STAGES}")
    preset = dict(LADDER[stage])
    factor = preset.pop("lists_per_sqrt_n", 0)
    if factor:
        # Few vectors per list makes k-means and PQ meaningless: keep >= ~39 points per list.
        preset["nlist"] = max(1, min(int(factor * np.sqrt(n)), n // 39))
    if preset.pop("codes", None) and not (overrides.get("pq_dsub") or overrides.get("sq_bits")):
        # Which codes, measured on the benchmark's two data sets (docs/retrieval.md):
        # - l2 (SIFT-like: tight, low-dimensional clusters far from the origin): 8-bit scalar codes.
        #   4-bit PQ needs residual codes there (raw PQ recall 0.34 vs 0.68), i.e. one look-up
        #   table per probed list, which made it 1.8x slower than FAISS HNSW at equal recall; SQ8
        #   is near exact (lossless on byte-valued data), so the re-rank shortlist stays short.
        # - ip (normalised sentence embeddings, weakly clustered, 384-d): 4-bit fast-scan PQ on the
        #   raw vectors, one look-up table per query; these need 64+ probes, and SQ8 scans d bytes
        #   per vector where PQ scans d/4 (~9x slower there).
        if metric == "l2":
            preset["sq_bits"] = 8
        else:
            preset.update(pq_dsub=2, pq_residual=False)
    if preset.get("pq_dsub") and dim % preset["pq_dsub"]:
        preset["pq_dsub"] = 1
    if overrides.get("pq_dsub") and "pq_residual" not in overrides:
        # Residual PQ codes pay off when lists are tight clusters far from the origin (l2 data);
        # for normalised embeddings the residual is as long as the vector (see above).
        preset["pq_residual"] = metric == "l2"
    preset.update(metric=metric, **overrides)
    return VectorConfig(**preset)


SQ8_BYTES = "bytes"  # 8-bit codes are the values themselves (data is integers in 0..255: lossless)
SQ8_TRAINED = "trained"  # 8-bit codes over a per-dimension range learnt from the training vectors


def _is_bytes(x: np.ndarray) -> bool:
    """Every value an integer in 0..255 (checked in blocks to bound the temporaries)."""
    if not len(x):
        return False
    for i in range(0, len(x), 65536):
        b = x[i:i + 65536]
        if not ((b >= 0) & (b <= 255) & (b == np.rint(b))).all():
            return False
    return True


class VectorIndex:
    def __init__(self, dim: int, config: VectorConfig | None = None):
        self.dim = dim
        self.config = config or VectorConfig()
        self.vectors = np.zeros((0, dim), dtype=np.float32)  # row i holds the vector of id i
        self.alive = np.zeros(0, dtype=bool)
        self.index = self._make_index()

    # ---- construction -------------------------------------------------------------------
    def _make_index(self, sq8: str = SQ8_TRAINED) -> faiss.Index:
        c, d = self.config, self.dim
        if c.nlist == 0:
            return faiss.IndexIDMap2(faiss.IndexFlatL2(d))
        quantizer = faiss.IndexHNSWFlat(d, c.hnsw_m) if c.coarse == "hnsw" else faiss.IndexFlatL2(d)
        if c.pq_dsub:
            if d % c.pq_dsub:
                raise ValueError(f"pq_dsub={c.pq_dsub} does not divide the dimension {d}")
            index = faiss.IndexIVFPQFastScan(quantizer, d, c.nlist, d // c.pq_dsub, 4)
            index.by_residual = c.pq_residual
        elif c.sq_bits:
            # Codes of the vectors themselves (not residuals), so byte-valued data keeps its bytes.
            qtype = faiss.ScalarQuantizer.QT_8bit_direct if sq8 == SQ8_BYTES else faiss.ScalarQuantizer.QT_8bit
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, c.nlist, qtype, faiss.METRIC_L2, False)
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
        """k-means the lists (unless `centroids` from another index are given) and train the codes
        (byte-valued data with `sq_bits=8` gets lossless byte codes, others a trained range)."""
        x = self._check(x, "train")
        c = self.config
        if self.index.is_trained or c.nlist == 0:
            return
        if len(x) < c.nlist:
            raise ValueError(f"cannot train {c.nlist} lists on {len(x)} vectors")
        if c.sq_bits and _is_bytes(x) and self.sq8_mode() != SQ8_BYTES:
            self.index = self._make_index(SQ8_BYTES)  # still empty and untrained
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

    def sq8_mode(self) -> str | None:
        """SQ8_BYTES or SQ8_TRAINED for 8-bit scalar codes, else None."""
        index = faiss.downcast_index(self.index)
        if not isinstance(index, faiss.IndexIVFScalarQuantizer):
            return None
        return SQ8_BYTES if index.sq.qtype == faiss.ScalarQuantizer.QT_8bit_direct else SQ8_TRAINED

    def _recode(self, more: np.ndarray) -> None:
        """Byte codes cannot hold `more` (not byte-valued): re-encode every stored vector with a
        trained 8-bit quantiser, keeping the lists (centroids) and the ids."""
        cents = self.centroids()
        keep = np.flatnonzero(self.alive)
        self.index = self._make_index(SQ8_TRAINED)
        if self.config.coarse == "hnsw":
            faiss.downcast_index(self.index.quantizer).hnsw.efSearch = 128
        self.index.quantizer.add(cents)
        self.index.quantizer.is_trained = True
        x = np.concatenate([self.vectors[keep], more])
        size = self.config.train_size or min(len(x), 256 * 1024)
        if size < len(x):
            x = x[np.random.default_rng(0).choice(len(x), size, replace=False)]
        self.index.train(x)  # the quantiser is full, so only the scalar ranges are learnt
        if len(keep):
            self.index.add_with_ids(self.vectors[keep], keep.astype(np.int64))

    def centroids(self) -> np.ndarray:
        """The list centroids (to share one k-means between ladder stages)."""
        q = self.index.quantizer
        return q.reconstruct_n(0, q.ntotal)

    def add(self, x: np.ndarray) -> np.ndarray:
        """Add vectors (training the index first if needed); returns their ids."""
        x = self._check(x, "add")
        if not self.index.is_trained:
            self.train(np.concatenate([self.vectors[self.alive], x]))
        elif self.sq8_mode() == SQ8_BYTES and len(x) and not _is_bytes(x):
            self._recode(x)
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
        """Exact squared L2 on the shortlist, top k kept (FAISS's by-index k-NN kernel, one call
        for the batch). Missing candidates (-1) come last in FAISS results; they stay missing."""
        cand = np.ascontiguousarray(cand, dtype=np.int64)
        nq, ns = cand.shape
        dist = np.empty((nq, k), dtype=np.float32)
        ids = np.empty((nq, k), dtype=np.int64)
        faiss.knn_L2sqr_by_idx(faiss.swig_ptr(xq), faiss.swig_ptr(self.vectors), faiss.swig_ptr(cand),
                               self.dim, nq, len(self.vectors), ns, k, faiss.swig_ptr(dist), faiss.swig_ptr(ids), ns)
        return dist, ids

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

