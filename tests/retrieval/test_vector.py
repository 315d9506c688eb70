"""The FAISS ladder: every stage finds the exact neighbours when searched exhaustively enough."""

import faiss
import numpy as np
import pytest

from openglm.retrieval.synthetic import sift_like_split
from openglm.retrieval.vector import STAGES, VectorConfig, VectorIndex, ladder_config

faiss.omp_set_num_threads(1)
DIM, K = 32, 10


@pytest.fixture(scope="module")
def data():
    xb, xq = sift_like_split(3000, 40, dim=DIM, n_clusters=30, intrinsic_dim=8, seed=1)
    d2 = ((xq[:, None, :] - xb[None, :, :]) ** 2).sum(-1)
    return xb, xq, np.argsort(d2, axis=1, kind="stable")[:, :K], d2


@pytest.fixture(scope="module")
def built(data):
    xb = data[0]
    out = {}
    for stage in STAGES:
        index = VectorIndex(DIM, ladder_config(stage, len(xb), DIM, metric="l2"))
        index.add(xb)
        out[stage] = index
    return out


def exhaustive(index):
    """Probe every list, keep every list when pruning, re-rank a shortlist of everything."""
    c = index.config
    if c.nlist:
        index.set_search(nprobe=c.nlist, prune_ratio=1e9 if c.prune_ratio else 0.0,
                         rerank=300 if c.pq_dsub else c.rerank)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_returns_exact_neighbours(built, data, stage):
    xb, xq, truth, d2 = data
    index = built[stage]
    exhaustive(index)
    dist, ids = index.search(xq, K)
    # Integer data has ties, so equal-distance ids may swap: compare the distances, and check
    # that every returned id really lies at its reported distance.
    np.testing.assert_allclose(dist, np.take_along_axis(d2, truth, 1), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(np.take_along_axis(d2, ids, 1), dist, rtol=1e-5, atol=1e-3)
    assert len(np.unique(ids[0])) == K


def test_pq_without_rerank_is_approximate_and_rerank_fixes_it(built, data):
    xb, xq, truth, d2 = data
    index = built["ivfpq"]
    index.set_search(nprobe=index.config.nlist, rerank=0)
    _, approx = index.search(xq, K)
    recall = np.mean([len(set(a) & set(t)) / K for a, t in zip(approx, truth)])
    assert 0.3 < recall < 1.0  # codes are lossy ...
    index.set_search(rerank=30)
    _, fixed = index.search(xq, K)
    assert np.mean([len(set(a) & set(t)) / K for a, t in zip(fixed, truth)]) > recall  # ... re-rank repairs


def test_pruning_ratio_one_probes_only_the_nearest_list(built, data):
    xb, xq, _, _ = data
    ivf = built["ivf"]
    pruned = VectorIndex(DIM, VectorConfig(metric="l2", nlist=ivf.config.nlist, nprobe=ivf.config.nlist,
                                           prune_ratio=1.0))
    pruned.train(xb, centroids=ivf.centroids())
    pruned.add(xb)
    ivf.set_search(nprobe=1)
    np.testing.assert_array_equal(pruned.search(xq, K)[1], ivf.search(xq, K)[1])
    # A looser ratio probes more lists per query and can only find closer neighbours.
    pruned.set_search(prune_ratio=2.0)
    d_loose = pruned.search(xq, K)[0]
    assert (d_loose[:, 0] <= ivf.search(xq, K)[0][:, 0] + 1e-4).all()


def test_persistence_round_trip_and_updates(built, data, tmp_path):
    xb, xq, _, _ = data
    index = built["rerank"]
    exhaustive(index)
    before = index.search(xq, K)
    index.save(tmp_path / "ix")
    loaded = VectorIndex.load(tmp_path / "ix")
    assert loaded.config == index.config and loaded.ntotal == len(xb)
    after = loaded.search(xq, K)
    np.testing.assert_array_equal(before[1], after[1])
    # Updates: remove the current best hits, add a vector equal to query 0.
    loaded.remove(np.unique(after[1][:, 0]))
    new_id = loaded.add(xq[:1])[0]
    dist, ids = loaded.search(xq, K)
    assert not np.isin(ids, after[1][:, 0]).any()
    assert ids[0, 0] == new_id and dist[0, 0] == pytest.approx(0.0, abs=1e-3)


def test_inner_product_scores_are_cosines():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    index = VectorIndex(16, VectorConfig(metric="ip"))
    index.add(x)
    scores, ids = index.search(x[:5], 3)
    assert (ids[:, 0] == np.arange(5)).all()
    np.testing.assert_allclose(scores, np.take_along_axis(x[:5] @ x.T, ids, 1), atol=1e-5)


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="normalised"):
        VectorIndex(4, VectorConfig(metric="ip")).add(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"expected shape \(n, 4\)"):
        VectorIndex(4, VectorConfig(metric="l2")).add(np.ones((3, 5), np.float32))
    with pytest.raises(ValueError, match="nlist > 0"):
        VectorConfig(pq_dsub=2)
    with pytest.raises(ValueError, match="unknown VectorConfig field"):
        VectorConfig.from_dict({"nlists": 4})
    with pytest.raises(ValueError, match="unknown ladder stage"):
        ladder_config("hnsw", 100, 4)
    with pytest.raises(FileNotFoundError, match="no vector index"):
        VectorIndex.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="build-time"):
        VectorIndex(4).set_search(nlist=3)


def test_residual_codes_follow_the_metric_and_survive_a_reload(tmp_path, data):
    assert ladder_config("rerank", 10**6, 128, metric="l2").pq_residual
    assert not ladder_config("rerank", 10**6, 384, metric="ip").pq_residual
    xb, xq, truth, _ = data
    index = VectorIndex(DIM, ladder_config("rerank", len(xb), DIM, metric="l2", pq_residual=False))
    index.add(xb)
    assert not index.index.by_residual
    index.set_search(nprobe=index.config.nlist, prune_ratio=0.0, rerank=30)
    before = index.search(xq, K)[1]
    index.save(tmp_path)
    again = VectorIndex.load(tmp_path)
    assert not again.config.pq_residual and not again.index.by_residual
    np.testing.assert_array_equal(again.search(xq, K)[1], before)
    assert np.mean([len(set(a) & set(t)) / K for a, t in zip(before, truth)]) > 0.95
