"""The Triton DSA kernels (`openglm.kernels.dsa`) against the model's own DSA ops (`model.sparse_dsa`).

Without CUDA these run in Triton's interpreter on the CPU (tests/conftest.py), at tiny shapes; with CUDA the
compiled kernels run. Tolerances (max |kernel - reference|, relative to max |reference| for the attention):
- indexer scores, fp32 products: 1e-5 relative; the selections are compared exactly (random continuous scores:
  a different choice would need two scores within fp32 rounding of each other at the k-th place);
- indexer with bf16 products (`score_dtype`): 1e-2 relative against the reference's bf16 scores;
- attention fp32: 1e-5; bf16: 2e-2 against the fp32 attention of the same bf16 inputs (probabilities are
  rounded to bf16 before the value product, and the output once).
"""

import pytest
import torch

from openglm.model.glm5 import sparse_dsa

kernels = pytest.importorskip("openglm.kernels.dsa", reason="triton is a test dependency (pyproject's test extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def indexer_inputs(b=2, tq=6, tk=40, heads=4, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, heads, dim, generator=g)
    k = torch.randn(b, tk, dim, generator=g)
    w = torch.rand(b, tq, heads, generator=g) * heads ** -0.5
    return q, k, w


def padding(b, tk, tq):
    """Row 0 left-padded by 7, row 1 with its last 2 query positions padding (right-padded chunk)."""
    valid = torch.ones(b, tk, dtype=torch.bool)
    valid[0, :7] = False
    valid[1, -2:] = False
    return valid


def dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("padded", [False, True])
def test_index_scores_match_the_models(padded):
    q, k, w = indexer_inputs()
    valid = padding(2, 40, 6) if padded else None
    scale = 16 ** -0.5
    keys, table, page = kernels.contiguous_table(k.to(DEVICE))
    got = kernels.index_scores(*dev(q, w * scale), keys, table, page, 40, *dev(valid)).cpu()
    ref = sparse_dsa.index_scores(q, k.transpose(1, 2), w, scale)  # every key, unmasked
    visible = torch.arange(40)[None, :] <= torch.arange(34, 40)[:, None]
    visible = visible[None] & (valid[:, None, :] & valid[:, 34:, None] if padded else True)
    assert torch.equal(torch.isinf(got), ~visible.expand_as(got))
    assert torch.allclose(got[visible.expand_as(got)], ref[visible.expand_as(ref)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tq,topk", [(6, 8), (1, 8), (6, 64)])  # prefill chunk, decode step, topk >= keys
def test_indexer_topk_selects_what_the_model_selects(padded, tq, topk):
    q, k, w = indexer_inputs(tq=tq)
    valid = padding(2, 40, tq) if padded else None
    got = kernels.indexer_topk(*dev(q, w * 16 ** -0.5, k), topk, key_valid=dev(valid)[0]).cpu()
    ref = sparse_dsa.indexer_topk(q, k, w, topk, key_mask=valid)
    assert torch.equal(got, ref)


def test_indexer_topk_in_query_chunks_and_bf16_products():
    q, k, w = indexer_inputs(tq=6)
    whole = kernels.indexer_topk(*dev(q, w * 0.25, k), 8).cpu()
    chunked = kernels.indexer_topk(*dev(q, w * 0.25, k), 8, budget_bytes=4 * 2 * 40 * 2).cpu()  # 2 queries a chunk
    assert torch.equal(whole, chunked)
    keys, table, page = kernels.contiguous_table(k.to(torch.bfloat16).to(DEVICE))
    got = kernels.index_scores(*dev(q.to(torch.bfloat16), w * 0.25), keys, table, page, 40).cpu()
    ref = sparse_dsa.index_scores(q, k.to(torch.bfloat16).transpose(1, 2), w, 0.25, torch.bfloat16).float()
    finite = torch.isfinite(got)
    assert float((got[finite] - ref[finite]).abs().max() / ref.abs().max()) < 1e-2


def paged(rows: torch.Tensor, page: int, seed: int = 3):
    """rows [B, N, W] scattered into a pool of pages in a shuffled order (plus a spare page), as the engine's
    KVPool holds them: (pool [pages * page, W], block table [B, N / page])."""
    b, n, width = rows.shape
    per_seq = -(-n // page)
    order = torch.randperm(b * per_seq + 1, generator=torch.Generator().manual_seed(seed))
    pool = torch.zeros(len(order) * page, width, dtype=rows.dtype)
    table = order[: b * per_seq].view(b, per_seq)
    for i in range(b):
        for j in range(n):
            pool[table[i, j // page] * page + j % page] = rows[i, j]
    return pool, table


def test_indexer_reads_the_paged_pool():
    q, k, w = indexer_inputs()
    pool, table = paged(k, page=16)
    got = kernels.indexer_topk(*dev(q, w * 0.25, pool), 8, table=table.to(DEVICE), page=16, n_keys=40).cpu()
    assert torch.equal(got, kernels.indexer_topk(*dev(q, w * 0.25, k), 8).cpu())


def attention_inputs(b=2, tq=5, tk=40, heads=20, rank=24, rope=8, n_top=12, dtype=torch.float32, seed=0):
    """Absorbed queries [B, Tq, H, rank + rope], latent keys [B, Tk, 1, rank + rope] (kv then k_pe, as one cache
    row) and top-k slots with unused (-1) entries, one query with none."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, heads, rank + rope, generator=g).to(dtype)
    keys = torch.randn(b, tk, 1, rank + rope, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(tk, generator=g)[:n_top] for _ in range(b * tq)]).view(b, tq, n_top)
    slots[0, 1, 5:] = -1
    slots[1, 2] = -1
    return q, keys, slots


def reference_attention(q, keys, slots, rank, scale):
    k = keys.transpose(1, 2).float()
    with torch.no_grad():
        out = sparse_dsa.gather_attention(q.float().transpose(1, 2), k, k[..., :rank], slots, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sparse_mla_attention_matches_the_models_gather(dtype, tol):
    # 20 heads: two head blocks, the second partial; rank 24 / rope 8: channel blocks wider than the data;
    # 12 slots: a partial slot tile
    q, keys, slots = attention_inputs(dtype=dtype)
    qd, kd, sd = dev(q, keys, slots)
    out = kernels.sparse_mla_attention(qd, kd[:, :, 0, :24], kd[:, :, 0, 24:], sd, 0.2).cpu()
    ref = reference_attention(q, keys, slots, 24, 0.2)
    assert out.dtype == dtype and out.shape == (2, 5, 20, 24)
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < tol
    assert not out[1, 2].any()  # a query with no selected key gets zeros


def test_sparse_mla_attention_reads_the_paged_pool():
    q, keys, slots = attention_inputs()
    kv_pool, table = paged(keys[:, :, 0, :24].contiguous(), page=16)
    pe_pool, _ = paged(keys[:, :, 0, 24:].contiguous(), page=16)
    qd, kd, sd = dev(q, keys, slots)
    contiguous = kernels.sparse_mla_attention(qd, kd[:, :, 0, :24], kd[:, :, 0, 24:], sd, 0.2).cpu()
    got = kernels.sparse_mla_attention(qd, *dev(kv_pool, pe_pool), sd, 0.2, table=table.to(DEVICE), page=16).cpu()
    assert torch.equal(got, contiguous)  # the same rows in the same order: the same sums


def test_bad_inputs_get_clear_errors():
    q, keys, slots = attention_inputs()
    with pytest.raises(ValueError, match="query width 32 != latent 20 \\+ rope 8"):
        kernels.sparse_mla_attention(q, keys[:, :, 0, :20], keys[:, :, 0, 24:], slots, 0.2)
    with pytest.raises(ValueError, match="slots \\(2, 4, 12\\), expected \\[2, 5, K\\]"):
        kernels.sparse_mla_attention(q, keys[:, :, 0, :24], keys[:, :, 0, 24:], slots[:, :4], 0.2)
    with pytest.raises(ValueError, match="a block table needs page and n_keys"):
        kernels.indexer_topk(*indexer_inputs()[:1], torch.rand(2, 6, 4), torch.zeros(8, 16), 4,
                             table=torch.zeros(2, 1, dtype=torch.int32))
