"""SIFT-like synthetic vectors: clustered, low intrinsic dimension, non-negative integers.

Real SIFT descriptors are 128-d histograms (non-negative, 0..255) whose local intrinsic dimension
is small (~10-20) and whose density is very uneven. Isotropic Gaussian blobs in 128-d are much
harder and much less realistic, so each cluster here is a random low-dimensional subspace with a
decaying spectrum around its centre, clusters have skewed sizes, and values are clipped at zero
and rounded like SIFT's bytes.
"""

from __future__ import annotations

import numpy as np


def sift_like(n: int, dim: int = 128, n_clusters: int = 1000, intrinsic_dim: int = 16,
              seed: int = 0) -> np.ndarray:
    """n float32 vectors (rows) in a random order; memory is about the output's size."""
    rng = np.random.default_rng(seed)
    centres = np.abs(rng.normal(0, 1, (n_clusters, dim))) * 40.0  # non-negative, SIFT-like scale
    # Per cluster: `intrinsic_dim` random directions with a decaying spectrum (local PCA shape).
    spectrum = 25.0 / np.sqrt(1 + np.arange(intrinsic_dim))
    bases = rng.normal(0, 1, (n_clusters, intrinsic_dim, dim)) / np.sqrt(dim) * spectrum[:, None]
    weights = rng.zipf(1.6, n_clusters).astype(np.float64)  # uneven cluster sizes
    weights = np.minimum(weights, np.quantile(weights, 0.99))
    counts = rng.multinomial(n, weights / weights.sum())
    out = np.empty((n, dim), dtype=np.float32)
    row = 0
    for c, m in enumerate(counts):
        x = centres[c] + rng.standard_normal((m, intrinsic_dim)) @ bases[c]
        x += 2.0 * rng.standard_normal(x.shape, dtype=np.float32)  # small full-dimensional noise
        out[row:row + m] = np.clip(np.rint(x), 0, 255)
        row += m
    return out[rng.permutation(n)]


def sift_like_split(n_base: int, n_query: int, dim: int = 128, seed: int = 0, **kw):
    """Base and query sets drawn from the same distribution (queries are not in the base)."""
    x = sift_like(n_base + n_query, dim, seed=seed, **kw)
    return x[:n_base], x[n_base:]
