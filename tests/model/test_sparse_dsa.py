"""DSA's native (C) kernels against its torch-op paths and against plain references.

Every test in test_sparse.py runs on the native path when a C compiler is present; here the two paths are
compared directly, and the kernels' edge cases (ties at the k-th score, an overshooting threshold sample, -1
slots anywhere, head sizes other than 64) are exercised one by one."""
import pytest
import torch

from openglm.model import native
from openglm.model.glm5 import sparse_dsa
from openglm.model.glm5.sparse_dsa import dsa_attention, gather_attention, indexer_topk

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def torch_ops(monkeypatch):
    """Runs the code under test on the torch-op path (as on a machine without a C compiler)."""
    monkeypatch.setattr(sparse_dsa, "dsa_kernels", lambda: None)


def both_paths(monkeypatch, fn):
    fast = fn()
    with monkeypatch.context() as m:
        m.setattr(sparse_dsa, "dsa_kernels", lambda: None)
        ops = fn()
    return fast, ops


def indexer_inputs(b=2, tq=300, tk=400, hi=4, di=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, tq, hi, di, generator=g), torch.randn(b, tk, di, generator=g),
            torch.rand(b, tq, hi, generator=g) - 0.2)  # some negative head weights, as a trained indexer has


@pytest.mark.needs_native
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("budget", [1 << 14, 1 << 26])
def test_native_indexer_selects_the_same_keys_as_the_torch_ops(monkeypatch, masked, budget):
    iq, ik, w = indexer_inputs()
    mask = torch.ones(2, 400, dtype=torch.long)
    mask[1, :37] = 0  # left padding
    kw = dict(key_mask=mask if masked else None, budget_bytes=budget)
    fast, ops = both_paths(monkeypatch, lambda: indexer_topk(iq, ik, w, 32, **kw))
    assert torch.equal(fast, ops)
    assert (fast[:, :, -1] >= 0).all()


@pytest.mark.needs_native
def test_native_bf16_indexer_picks_a_top_k_of_its_fp32_head_sum():
    iq, ik, w = indexer_inputs(b=1, tq=200, tk=5000, seed=1)  # rows long enough for the threshold sample
    got = indexer_topk(iq, ik, w, 64, score_dtype=torch.bfloat16)
    heads = torch.einsum("bqhd,bkd->bqhk", iq.bfloat16(), ik.bfloat16()).relu().float()  # bf16 matmul, as oneDNN
    sc = torch.einsum("bqh,bqhk->bqk", w * 8 ** -0.5, heads)
    sc = sc.masked_fill(torch.ones(200, 5000, dtype=torch.bool).triu(4801), float("-inf"))
    for i in range(200):
        chosen = sc[0, i, got[0, i]]
        rest = sc[0, i].clone()
        rest[got[0, i]] = float("-inf")
        assert got[0, i].unique().numel() == 64
        assert chosen.min() >= rest.max() - 1e-5 * chosen.abs().max()


def native_rows_topk(rows, n_keys, n_top, n_sample):
    lib = native.dsa_kernels()
    rows = rows.contiguous().clone()
    nq, width = rows.shape
    out = torch.empty(nq, n_top, dtype=torch.long)
    n_keys, work = torch.as_tensor(n_keys, dtype=torch.long), torch.empty(4 * width)  # alive during the call
    lib.dsa_rows_topk(rows.data_ptr(), width, nq, n_keys.data_ptr(), None, 0, n_top, sparse_dsa.PREFILTER_STRIDE,
                      n_sample, out.data_ptr(), n_top, work.data_ptr(), None)
    return out


@pytest.mark.needs_native
def test_native_row_top_k_handles_ties_overshoot_and_short_rows():
    g = torch.Generator().manual_seed(2)
    n_top, width = 32, 4096
    rows = torch.randn(5, width, generator=g)
    rows[1, :7] = rows[1].topk(n_top).values[-1]  # several slots tied at the k-th score
    rows[2] = torch.rand(width, generator=g)
    rows[2, ::sparse_dsa.PREFILTER_STRIDE] += 10.0  # the sampled scores are the largest: the sample overshoots
    rows[3, 100:] = float("-inf")  # invisible keys
    rows[4] = rows[4].round()  # heavy ties everywhere
    n_keys = [width, width, width, width, 20]  # row 4 sees fewer keys than k: -1 first
    got = native_rows_topk(rows, n_keys, n_top, n_sample=int(1.25 * n_top / 16))
    for r in range(4):
        slots = got[r]
        assert torch.equal(slots, slots.sort().values) and slots.unique().numel() == n_top
        rest = rows[r].clone()
        rest[slots] = float("-inf")
        assert rows[r, slots].min() >= rest.max()
    assert torch.equal(got[4], torch.cat([torch.full((12,), -1), torch.arange(20)]))


@pytest.mark.needs_native
def test_native_row_top_k_at_production_sizes():
    """k = 2048 of up to 40K keys: both selections (sample threshold, k-th candidate) take the bracketing passes."""
    g = torch.Generator().manual_seed(8)
    n_top, width = 2048, 40_000
    rows = torch.randn(4, width, generator=g)
    rows[1] = (rows[1] * 4).round()  # few distinct values: brackets that make no progress
    rows[2] = rows[2].abs().bfloat16().float()  # bf16-like ties
    rows[3, ::7] = 5.0  # a block of equal maxima larger than k
    n_keys = [width, width, 30_000, width]
    got = native_rows_topk(rows, n_keys, n_top, n_sample=int(1.25 * n_top / 16))
    for r, n in enumerate(n_keys):
        row = rows[r, :n]
        slots = got[r]
        assert torch.equal(slots, slots.sort().values) and slots.unique().numel() == n_top and slots.max() < n
        rest = row.clone()
        rest[slots] = float("-inf")
        assert row[slots].min() >= rest.max()


@pytest.mark.needs_native
def test_native_row_top_k_keeps_the_first_tied_slots_like_the_torch_path():
    rows = torch.zeros(1, 300)
    rows[0, 250:] = 1.0  # 50 slots above, the rest tied at the k-th score
    got = native_rows_topk(rows, [300], 64, n_sample=0)
    assert torch.equal(got[0], torch.cat([torch.arange(14), torch.arange(250, 300)]))


def reference_attention(q, k, v, idx, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    hits = torch.zeros(s.shape[0], s.shape[2], s.shape[3]).scatter_add_(-1, idx.clamp(min=0), (idx >= 0).float())
    allow = hits > 0
    s = s.masked_fill(~allow[:, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@pytest.mark.needs_native
@pytest.mark.parametrize("dk,dv", [(64, 64), (10, 7), (40, 64)])
def test_native_gather_matches_reference_and_torch_ops(monkeypatch, dk, dv):
    g = torch.Generator().manual_seed(3)
    b, h, hkv, t, n_top = 2, 4, 2, 90, 24
    q, k, v = (torch.randn(b, h, t, dk, generator=g), torch.randn(b, hkv, t, dk, generator=g),
               torch.randn(b, hkv, t, dv, generator=g))
    idx = torch.stack([torch.stack([torch.randperm(t, generator=g)[:n_top] for _ in range(t)]) for _ in range(b)])
    idx[idx > torch.arange(t)[None, :, None]] = -1  # -1 anywhere, rows unsorted
    idx[1, 5] = -1  # a query with nothing selected returns zeros
    fast, ops = both_paths(monkeypatch, lambda: gather_attention(q, k, v, idx, scale=0.3))
    torch.testing.assert_close(fast, ops, **TOL)
    torch.testing.assert_close(fast, reference_attention(q, k, v, idx, 0.3), **TOL)
    assert torch.equal(fast[1, :, 5], torch.zeros_like(fast[1, :, 5]))


@pytest.mark.needs_native
def test_native_dsa_attention_equals_torch_ops_over_many_blocks(monkeypatch):
    g = torch.Generator().manual_seed(4)
    b, h, t = 1, 2, 700
    q, k, v = (torch.randn(b, h, t, 64, generator=g) for _ in range(3))
    iq, ik, w = indexer_inputs(b=1, tq=t, tk=t, seed=5)
    # rarely all heads cut by the relu: no exact ties at 0, which each path breaks its own way
    iq, ik = iq + 1.0, ik + 1.0

    def run():
        return dsa_attention(q, k, v, iq, ik, w, 96, budget_bytes=1 << 17)  # several blocks and chunks

    fast, ops = both_paths(monkeypatch, run)
    torch.testing.assert_close(fast, ops, **TOL)


@pytest.mark.needs_native
def test_native_exp_is_accurate_to_a_few_ulp():
    x = torch.cat([torch.linspace(-87.0, 0.0, 100_001), torch.tensor([-1e-30, -0.0, -100.0])])
    got = x.clone()
    zero_max = torch.zeros(1)
    pair_q = torch.zeros(x.numel(), dtype=torch.int32)
    native.dsa_kernels().dsa_pair_exp(got.data_ptr(), pair_q.data_ptr(), zero_max.data_ptr(), x.numel())
    ref = torch.exp(x.double())
    rel = ((got.double() - ref) / ref)[:-1]
    assert rel.abs().max() < 5e-7
    assert 0 <= got[-1] < 1e-37  # below the clamp: a tiny weight, never inf or nan


def test_torch_op_path_still_matches_the_native_contract(torch_ops):
    q, k, v = (torch.randn(1, 2, 50, 8) for _ in range(3))
    iq, ik, w = indexer_inputs(b=1, tq=50, tk=50, seed=6)
    out = dsa_attention(q, k, v, iq, ik, w, 12)
    assert sparse_dsa.dsa_kernels() is None and torch.isfinite(out).all()


def test_no_compiler_falls_back_to_torch_ops(monkeypatch):
    available = native.dsa_kernels() is not None
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.dsa_kernels.cache_clear()
    try:
        assert native.dsa_kernels() is None
        q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
        iq, ik, w = indexer_inputs(b=1, tq=40, tk=40, seed=7)
        assert torch.isfinite(dsa_attention(q, k, v, iq, ik, w, 8)).all()
    finally:
        monkeypatch.undo()
        native.dsa_kernels.cache_clear()
    assert (native.dsa_kernels() is not None) == available


def test_gather_rejects_slots_past_the_cache():
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    with pytest.raises(IndexError):
        gather_attention(q, k, v, torch.full((1, 10, 3), 10))


@pytest.mark.parametrize("budget", [1 << 12, 1 << 26])  # several query blocks (rows shorter than Tk), or one
def test_ties_at_the_kth_score_pick_what_torch_topk_picks_over_the_whole_row(monkeypatch, budget):
    """Exact ties at the k-th score (relu zeros: every index head's dot product negative) are settled as the
    reference formulation settles them, torch.topk over a row of all Tk scores with -inf where invisible, so
    the model selects what transformers selects; on the native and the torch-op path alike."""
    g = torch.Generator().manual_seed(9)
    b, t, hi, di, k = 2, 60, 2, 8, 12
    iq = torch.randn(b, t, hi, di, generator=g).abs()
    ik = -torch.randn(b, t, di, generator=g).abs()  # every dot product negative: scores exactly 0 ...
    ik[:, ::7] *= -1  # ... but for every 7th key
    w = torch.rand(b, t, hi, generator=g)
    sc = torch.einsum("bqh,bqhk->bqk", w, torch.relu(torch.einsum("bqhd,bkd->bqhk", iq, ik) * di ** -0.5))
    sc = sc.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    vals, ref = sc.topk(k, -1)
    ref = ref.masked_fill(vals == float("-inf"), -1).sort(-1).values
    assert ((sc == 0).sum(-1) > k).any()  # ties at the k-th score do occur
    fast, ops = both_paths(monkeypatch, lambda: indexer_topk(iq, ik, w, k, budget_bytes=budget))
    assert torch.equal(fast.sort(-1).values, ref) and torch.equal(ops.sort(-1).values, ref)  # as sets
