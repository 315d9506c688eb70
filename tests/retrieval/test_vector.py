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
                         rerank=300 if c.pq_dsub or c.sq_bits else c.rerank)


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


def test_pq_without_rerank_is_approximate_and_rerank_fixes_it(data):
    xb, xq, truth, d2 = data
    index = VectorIndex(DIM, ladder_config("ivfpq", len(xb), DIM, metric="l2", pq_dsub=2))
    assert index.config.sq_bits == 0 and index.config.pq_residual
    index.add(xb)
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


def test_codes_follow_the_metric_and_survive_a_reload(tmp_path, data):
    l2, ip = ladder_config("rerank", 10**6, 128, metric="l2"), ladder_config("rerank", 10**6, 384, metric="ip")
    assert (l2.sq_bits, l2.pq_dsub) == (8, 0)
    assert (ip.sq_bits, ip.pq_dsub, ip.pq_residual) == (0, 2, False)
    assert ladder_config("rerank", 10**6, 128, metric="l2", pq_dsub=2).pq_residual
    xb, xq, truth, _ = data
    index = VectorIndex(DIM, ladder_config("rerank", len(xb), DIM, metric="l2", pq_dsub=2, pq_residual=False))
    index.add(xb)
    assert not index.index.by_residual
    index.set_search(nprobe=index.config.nlist, prune_ratio=0.0, rerank=30)
    before = index.search(xq, K)[1]
    index.save(tmp_path)
    again = VectorIndex.load(tmp_path)
    assert not again.config.pq_residual and not again.index.by_residual
    np.testing.assert_array_equal(again.search(xq, K)[1], before)
    assert np.mean([len(set(a) & set(t)) / K for a, t in zip(before, truth)]) > 0.95


def _float_data(n, seed):
    """Not byte-valued: unit-scale, negative values, fractions."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, DIM)).astype(np.float32)
    return (centres[rng.integers(0, 20, n)] + 0.3 * rng.normal(size=(n, DIM))).astype(np.float32)


def test_sq8_stores_bytes_losslessly_and_other_data_with_a_trained_range(built, data):
    xb, xq, truth, d2 = data
    index = built["ivfpq"]  # l2 preset: 8-bit scalar codes; sift-like values are bytes
    assert index.config.sq_bits == 8 and index.sq8_mode() == "bytes"
    index.set_search(nprobe=index.config.nlist, rerank=0)
    dist, _ = index.search(xq, K)  # no re-rank: the codes are the vectors themselves
    np.testing.assert_allclose(dist, np.take_along_axis(d2, truth, 1), rtol=1e-5, atol=1e-3)

    xf = _float_data(2000, 3)
    qf = _float_data(30, 4)
    exact = np.argsort(((qf[:, None] - xf[None]) ** 2).sum(-1), axis=1, kind="stable")[:, :K]
    fl = VectorIndex(DIM, VectorConfig(metric="l2", nlist=20, sq_bits=8, nprobe=20))
    fl.add(xf)
    assert fl.sq8_mode() == "trained"
    _, approx = fl.search(qf, K)
    r_approx = np.mean([len(set(a) & set(t)) / K for a, t in zip(approx, exact)])
    assert 0.5 < r_approx  # 8-bit codes are close ...
    fl.set_search(rerank=10)
    _, fixed = fl.search(qf, K)
    assert np.mean([len(set(a) & set(t)) / K for a, t in zip(fixed, exact)]) == 1.0  # ... and re-ranked exact


def test_sq8_byte_codes_re_encode_when_non_byte_vectors_arrive(data, tmp_path):
    xb, xq, _, _ = data
    index = VectorIndex(DIM, ladder_config("rerank", len(xb), DIM, metric="l2"))
    index.add(xb)
    assert index.sq8_mode() == "bytes"
    index.remove([0, 1, 2])
    extra = xq[:5] + 0.25  # off the byte grid: byte codes cannot hold these
    new = index.add(extra)
    assert index.sq8_mode() == "trained" and index.ntotal == len(xb) - 3 + 5
    index.set_search(nprobe=index.config.nlist, prune_ratio=0.0, rerank=30)
    dist, ids = index.search(xq[:5], K)
    np.testing.assert_array_equal(ids[:, 0], new)  # each query's shifted copy is its nearest
    np.testing.assert_allclose(dist[:, 0], np.full(5, 0.25 ** 2 * DIM), rtol=1e-4)
    assert not np.isin(ids, [0, 1, 2]).any()
    index.save(tmp_path)
    again = VectorIndex.load(tmp_path)
    assert again.sq8_mode() == "trained"
    np.testing.assert_array_equal(again.search(xq[:5], K)[1], ids)


def test_rerank_shortlist_longer_than_the_candidates_pads_with_missing(data):
    xb, xq, _, d2 = data
    index = VectorIndex(DIM, VectorConfig(metric="l2", nlist=60, sq_bits=8, nprobe=1, rerank=1000))
    index.add(xb[:200])  # ~3 vectors per list: one probe finds fewer than k
    dist, ids = index.search(xq, K)
    assert (ids == -1).any() and np.isinf(dist[ids == -1]).all()
    found = ids >= 0
    assert found[:, 0].all()
    # every real hit sits at its reported exact distance, in order
    np.testing.assert_allclose(np.take_along_axis(d2[:, :200], np.where(found, ids, 0), 1)[found], dist[found],
                               rtol=1e-5, atol=1e-3)
    assert (np.diff(np.where(found, dist, 1e30), axis=1) >= 0).all()
