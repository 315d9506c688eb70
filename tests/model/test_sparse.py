"""Sparse attention kernels against a naive dense-with-mask reference (fp32, tolerance 1e-5)."""
import pytest
import torch

from openglm.model.glm5.sparse_dsa import dsa_attention, gather_attention, indexer_topk
from openglm.model.sparse import attention, mla_absorbed
from openglm.model.sparse_patterns import SparsePattern, allowed, candidates, key_positions, random_positions

TOL = dict(atol=1e-5, rtol=1e-5)
# Small numbers so that every rule (local, global, random, padding) matters at T ~ 40.
PATTERNS = {
    "dense": SparsePattern("dense"),
    "sliding_window": SparsePattern.sliding(6),
    "local_global_random": SparsePattern.lgr(window=5, global_stride=4, n_random=3, seed=7, random_block=4),
}


def rule(pattern, qp, kp):
    """The pattern's definition, written out for one (query position, key position) pair."""
    if kp > qp:
        return False
    if pattern.kind == "dense":
        return True
    if qp - kp < pattern.window:
        return True
    if pattern.kind == "sliding_window":
        return False
    return kp % pattern.global_stride == 0 or kp in random_positions(pattern, qp // pattern.random_block)


def naive_mask(pattern, mask, n_queries):
    """[B, Tq, Tk] by loops over slots; positions count the real tokens, as documented."""
    b, tk = mask.shape
    out = torch.zeros(b, n_queries, tk, dtype=torch.bool)
    for bi in range(b):
        pos = (mask[bi].long().cumsum(0) - 1).tolist()
        for qi in range(n_queries):
            i = tk - n_queries + qi
            for j in range(tk):
                out[bi, qi, j] = bool(mask[bi, i] and mask[bi, j] and rule(pattern, pos[i], pos[j]))
    return out


def naive_attention(q, k, v, allow, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allow[:, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def padded_batch(lengths, total, left):
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, (n, is_left) in enumerate(zip(lengths, left)):
        if is_left:
            mask[i, total - n:] = 1
        else:
            mask[i, :n] = 1
    return mask


def qkv(b=3, h=4, hkv=2, t=40, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, dk, generator=g), torch.randn(b, hkv, t, dk, generator=g),
            torch.randn(b, hkv, t, dv, generator=g))


@pytest.mark.parametrize("kind", list(PATTERNS))
@pytest.mark.parametrize("chunk", [None, 3])
def test_pattern_matches_dense_mask_reference_with_padding(kind, chunk):
    q, k, v = qkv()
    mask = padded_batch([40, 29, 17], 40, left=[True, True, False])
    out = attention(q, k, v, PATTERNS[kind], key_mask=mask, query_chunk=chunk)
    ref = naive_attention(q, k, v, naive_mask(PATTERNS[kind], mask, 40))
    torch.testing.assert_close(out, ref, **TOL)
    assert out[1, :, :11].abs().max() == 0  # padding queries give zeros, not NaN


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_padded_row_equals_unpadded_sequence(kind):
    q, k, v = qkv(b=1, t=30, seed=1)
    alone = attention(q, k, v, PATTERNS[kind])
    pad = 7
    qp, kp, vp = (torch.cat([torch.randn(1, x.shape[1], pad, x.shape[3]), x], 2) for x in (q, k, v))
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, 30, dtype=torch.long)], 1)
    padded = attention(qp, kp, vp, PATTERNS[kind], key_mask=mask, query_chunk=4)
    torch.testing.assert_close(padded[:, :, pad:], alone, **TOL)


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_prefill_then_decode_equals_full_forward(kind):
    q, k, v = qkv(b=2, seed=2)
    mask = padded_batch([40, 33], 40, left=[False, True])
    full = attention(q, k, v, PATTERNS[kind], key_mask=mask)
    steps = [attention(q[:, :, :13], k[:, :, :13], v[:, :, :13], PATTERNS[kind], key_mask=mask[:, :13])]
    steps.append(attention(q[:, :, 13:21], k[:, :, :21], v[:, :, :21], PATTERNS[kind], key_mask=mask[:, :21],
                           query_chunk=3))  # a chunked prefill continuing from a cache
    for t in range(21, 40):  # one token at a time
        steps.append(attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], PATTERNS[kind],
                               key_mask=mask[:, :t + 1]))
    torch.testing.assert_close(torch.cat(steps, 2), full, **TOL)


def test_lgr_pattern_is_strictly_causal():
    pattern = SparsePattern.lgr(window=8, global_stride=4, n_random=5, seed=3, random_block=4)
    for block in range(40):
        rpos = random_positions(pattern, block)
        assert len(rpos) == min(5, block * 4) == len(set(rpos))
        assert all(0 <= p < block * 4 for p in rpos)  # strictly before the block's first query
        assert rpos == random_positions(pattern, block)  # reproducible: prefill and decode agree
    # Directly on the block-sparse rule: no (query, key) entry the kernel admits lies in the future.
    n = 160
    kpos, valid = key_positions(None, None, 1, n)
    for start in range(0, n, 16):
        cand = candidates(pattern, kpos, valid, start, start + 16)
        qpos, qv = kpos[:, start:start + 16], valid[:, start:start + 16]
        assert cand.hi == start + 16
        ok = allowed(pattern, qpos, qv, kpos[:, cand.lo:cand.hi], valid[:, cand.lo:cand.hi])
        assert not (ok & (kpos[:, None, cand.lo:cand.hi] > qpos[:, :, None])).any()
        if cand.slots is not None:
            gp = kpos.gather(1, cand.slots.clamp(min=0))
            ok = allowed(pattern, qpos, qv, gp, cand.slots >= 0, cand.tags)
            assert not (ok & (gp[:, None, :] > qpos[:, :, None])).any()
    # And functionally: changing the future never changes the past.
    q, k, v = qkv(b=1, t=n, seed=4)
    out = attention(q, k, v, pattern)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 100:] += 5.0
    v2[:, :, 100:] -= 3.0
    torch.testing.assert_close(attention(q, k2, v2, pattern)[:, :, :100], out[:, :, :100], **TOL)


def test_decode_step_reads_bounded_keys():
    pattern = SparsePattern.lgr(window=64, global_stride=16, n_random=8, random_block=16)
    n = 4096
    kpos, valid = key_positions(None, None, 1, n)
    cand = candidates(pattern, kpos, valid, n - 1, n)
    assert cand.hi - cand.lo == 64  # the local window only
    assert cand.slots.shape[1] <= n // 16 + 8  # global keys + random keys, never the whole cache
    cand = candidates(SparsePattern.sliding(100), kpos, valid, n - 1, n)
    assert (cand.hi - cand.lo, cand.slots) == (100, None)


def naive_indexer(iq, ik, w, topk, mask, scale):
    sc = torch.relu(torch.einsum("bqhd,bkd->bqhk", iq, ik) * scale)
    sc = torch.einsum("bqh,bqhk->bqk", w, sc)
    allow = naive_mask(SparsePattern("dense"), mask, iq.shape[1])
    sc = sc.masked_fill(~allow, float("-inf"))
    return sc.topk(min(topk, ik.shape[1]), -1).indices, allow


@pytest.mark.parametrize("chunk_budget", [1 << 10, 1 << 13, 1 << 26])  # 1 << 13: chunks of 2 blocks
def test_dsa_gather_matches_dense_mask_reference(chunk_budget):
    q, k, v = qkv(b=3, h=4, hkv=1, t=36, dk=10, dv=7, seed=5)  # MQA, as MLA's absorbed form
    g = torch.Generator().manual_seed(6)
    # Shifted queries: some heads are cut by the relu, but rarely all, so the top-k has no ties at 0.
    iq = torch.randn(3, 36, 4, 8, generator=g) + 1.0
    ik, w = torch.randn(3, 36, 8, generator=g) + 1.0, torch.rand(3, 36, 4, generator=g)
    mask = padded_batch([36, 25, 30], 36, left=[True, False, True])
    idx = indexer_topk(iq, ik, w, topk=9, scale=0.3, key_mask=mask, budget_bytes=chunk_budget)
    ref_idx, allow = naive_indexer(iq, ik, w, 9, mask, 0.3)
    assert (torch.relu(torch.einsum("bqhd,bkd->bqhk", iq, ik)) == 0).any()  # the relu matters here
    # transformers' formulation: scatter the top-k into a dense mask, intersect with causal + padding.
    dense = torch.zeros_like(allow).scatter(-1, ref_idx, True) & allow
    got = torch.zeros_like(allow)
    for b in range(3):
        for i in range(36):
            sel = idx[b, i][idx[b, i] >= 0]
            got[b, i, sel] = True
    assert torch.equal(got, dense)
    out = gather_attention(q, k, v, idx, budget_bytes=chunk_budget)
    torch.testing.assert_close(out, naive_attention(q, k, v, dense), **TOL)
    # Fused per query block (the top-k never exists for the whole sequence): same result.
    fused = dsa_attention(q, k, v, iq, ik, w, 9, index_scale=0.3, key_mask=mask, budget_bytes=chunk_budget)
    torch.testing.assert_close(fused, out, **TOL)


def test_dsa_prefill_then_decode_equals_full_forward():
    q, k, v = qkv(b=2, h=4, hkv=2, t=30, seed=8)
    g = torch.Generator().manual_seed(9)
    iq, ik, w = (torch.randn(2, 30, 3, 8, generator=g) + 1.0, torch.randn(2, 30, 8, generator=g) + 1.0,
                 torch.rand(2, 30, 3, generator=g))
    mask = padded_batch([30, 24], 30, left=[False, True])

    def run(a, e):
        idx = indexer_topk(iq[:, a:e], ik[:, :e], w[:, a:e], 6, key_mask=mask[:, :e])
        return gather_attention(q[:, :, a:e], k[:, :, :e], v[:, :, :e], idx)
    steps = [run(0, 17)] + [run(t, t + 1) for t in range(17, 30)]
    torch.testing.assert_close(torch.cat(steps, 2), run(0, 30), **TOL)


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_mla_absorbed_form_equals_expanded_heads(kind):
    g = torch.Generator().manual_seed(10)
    b, h, t, dn, dr, r, dvh = 2, 3, 24, 5, 4, 12, 6
    q_nope, q_pe = torch.randn(b, h, t, dn, generator=g), torch.randn(b, h, t, dr, generator=g)
    lat, k_pe = torch.randn(b, t, r, generator=g), torch.randn(b, t, dr, generator=g)
    w_uk, w_uv = torch.randn(h, dn, r, generator=g), torch.randn(h, r, dvh, generator=g)
    scale = (dn + dr) ** -0.5
    # Expanded: per-head keys [k_nope, k_pe] and values, as the unabsorbed MLA computes them.
    k_nope = torch.einsum("btr,hdr->bhtd", lat, w_uk)
    k_full = torch.cat([k_nope, k_pe[:, None].expand(b, h, t, dr)], -1)
    v_full = torch.einsum("btr,hrd->bhtd", lat, w_uv)
    ref = attention(torch.cat([q_nope, q_pe], -1), k_full, v_full, PATTERNS[kind], scale=scale)
    q, k, v = mla_absorbed(q_nope, q_pe, w_uk, lat, k_pe)
    out = torch.einsum("bhtr,hrd->bhtd", attention(q, k, v, PATTERNS[kind], scale=scale), w_uv)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_dsa_gather_autograd_path_equals_inference_path():
    q, k, v = qkv(b=2, h=4, hkv=2, t=30, seed=11)
    g = torch.Generator().manual_seed(12)
    idx = torch.randint(0, 30, (2, 30, 7), generator=g)
    idx = torch.where(idx <= torch.arange(30)[None, :, None], idx, -1)  # causal; early rows partly unused
    idx[1, 4] = -1  # a query with nothing selected returns zeros
    with torch.no_grad():
        fast = gather_attention(q, k, v, idx)
    qg = q.clone().requires_grad_()
    slow = gather_attention(qg, k, v, idx)
    torch.testing.assert_close(slow, fast, **TOL)
    assert torch.equal(fast[1, :, 4], torch.zeros_like(fast[1, :, 4]))
    slow.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_dsa_bf16_indexer_selects_the_top_k_of_bf16_scores():
    g = torch.Generator().manual_seed(13)
    iq, ik = torch.randn(1, 40, 2, 16, generator=g), torch.randn(1, 40, 16, generator=g)
    w = torch.rand(1, 40, 2, generator=g)
    got = indexer_topk(iq, ik, w, topk=8, score_dtype=torch.bfloat16)
    sc = torch.relu(torch.einsum("bqhd,bkd->bqhk", iq.bfloat16(), ik.bfloat16())).float() * 16 ** -0.5
    sc = torch.einsum("bqh,bqhk->bqk", w.bfloat16().float(), sc)
    sc = sc.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    for i in range(8, 40):  # rows with more visible keys than k: the k chosen are the k best (ties aside)
        chosen = sc[0, i, got[0, i]]
        rest = sc[0, i].clone()
        rest[got[0, i]] = float("-inf")
        assert chosen.min() >= rest.max() - 0.05 * chosen.abs().max()


def test_dsa_rejects_bad_score_dtype_and_scale():
    iq, ik, w = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 4), torch.rand(1, 5, 2)
    with pytest.raises(ValueError, match="score_dtype"):
        indexer_topk(iq, ik, w, 2, score_dtype=torch.float16)
    with pytest.raises(ValueError, match="positive"):
        indexer_topk(iq, ik, w, 2, scale=-1.0)


def test_topk_prefilter_is_exact_and_falls_back_when_the_sample_overshoots():
    from openglm.model.glm5 import sparse_dsa
    g = torch.Generator().manual_seed(14)
    n_top, tk = 32, 4096  # long enough rows for the prefilter
    sc = torch.randn(2, 5, tk, generator=g)
    sc[0, 1, 2000:] = float("-inf")  # causal / padding cut
    sc[0, 2, 20:] = float("-inf")  # fewer visible keys than k: -1 entries
    sc[1, 3] = torch.rand(tk, generator=g)
    sc[1, 3, ::sparse_dsa.PREFILTER_STRIDE] += 10.0  # the sampled scores are the largest: sample overshoots
    got = sparse_dsa._top_slots(sc, n_top)
    vals, ref = sc.topk(n_top, -1)
    ref = ref.masked_fill(vals == float("-inf"), -1)
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)
    assert (got[0, 2] == -1).sum() == n_top - 20


def test_topk_prefilter_breaks_ties_at_the_kth_score_like_plain_topk():
    from openglm.model.glm5 import sparse_dsa
    g = torch.Generator().manual_seed(17)
    n_top, tk = 32, 4096
    sc = torch.randn(3, tk, generator=g)
    kth = sc[1].topk(n_top).values[-1]
    sc[1, :5] = kth  # the k-th best score is shared by several slots: any n_top of them is a top-k
    got = sparse_dsa._top_slots(sc[None], n_top)[0]
    for row, slots in zip(sc, got):
        assert slots.unique().numel() == n_top
        rest = row.clone()
        rest[slots] = float("-inf")
        assert row[slots].min() >= rest.max()


def test_indexer_without_padding_equals_the_general_mask_path():
    g = torch.Generator().manual_seed(18)
    iq, ik, w = (torch.randn(2, 300, 2, 8, generator=g), torch.randn(2, 400, 8, generator=g),
                 torch.rand(2, 300, 2, generator=g))
    plain = indexer_topk(iq, ik, w, 32, budget_bytes=1 << 16)  # causal triangle only, prefiltered rows
    general = indexer_topk(iq, ik, w, 32, key_mask=torch.ones(2, 400, dtype=torch.bool), budget_bytes=1 << 16)
    assert torch.equal(plain, general)
    assert (plain[:, :, -1] >= 0).all() and (plain < torch.arange(100, 400)[None, :, None] + 1).all()


def test_dsa_bf16_values_stay_close_to_fp32():
    q, k, v = qkv(b=1, h=4, hkv=1, t=48, dk=8, dv=8, seed=15)
    g = torch.Generator().manual_seed(16)
    iq, ik, w = (torch.randn(1, 48, 2, 8, generator=g), torch.randn(1, 48, 8, generator=g),
                 torch.rand(1, 48, 2, generator=g))
    exact = dsa_attention(q, k, v, iq, ik, w, 12)
    fast = dsa_attention(q, k, v, iq, ik, w, 12, value_dtype=torch.bfloat16)
    assert not torch.equal(fast, exact)  # the option does change the arithmetic
    torch.testing.assert_close(fast, exact, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="value_dtype"):
        dsa_attention(q, k, v, iq, ik, w, 12, value_dtype=torch.float16)
