"""The paged cache returns exactly what a contiguous cache would, in the padded step layout."""

import torch

from openglm.engine.kv_cache import KVPool, PagedBatchCache
from openglm.engine.model_runner import PAD_WASTE, group_rows


def test_paged_cache_round_trips_entries_through_scattered_blocks():
    pool = KVPool(num_blocks=12, block_size=4)
    tables = [[7, 2, 9], [0, 11]]  # deliberately non-contiguous blocks
    seqs = [torch.randn(1, 10, 3), torch.randn(1, 6, 3)]  # full per-sequence histories
    # step 1: prefill 7 and 4 tokens
    step1 = PagedBatchCache(pool, tables, past_lens=[0, 0], new_lens=[7, 4])
    new = torch.zeros(2, 7, 3)
    new[0, :7], new[1, :4] = seqs[0][0, :7], seqs[1][0, :4]
    out = step1.update(0, {"kv": new})["kv"]
    assert torch.equal(out, new)
    # step 2: 3 and 2 more tokens; the past comes back right-aligned, the new tokens left-aligned
    step2 = PagedBatchCache(pool, tables, past_lens=[7, 4], new_lens=[3, 2])
    assert step2.get_seq_length() == 7
    new = torch.zeros(2, 3, 3)
    new[0], new[1, :2] = seqs[0][0, 7:10], seqs[1][0, 4:6]
    full = step2.update(0, {"kv": new})["kv"]
    assert full.shape == (2, 10, 3)
    assert torch.equal(full[0], seqs[0][0])
    assert torch.equal(full[1, 3:9], seqs[1][0]) and not full[1, :3].any() and not full[1, 9:].any()
    assert pool.bytes_per_token() == 3 * 4


def test_group_rows_covers_every_row_and_bounds_padding():
    counts = [1, 1, 200, 1, 37, 40, 1, 180]
    groups = group_rows(counts)
    assert sorted(i for g in groups for i in g) == list(range(len(counts)))
    for g in groups:
        longest = max(counts[i] for i in g)
        assert len(g) * longest <= PAD_WASTE * sum(counts[i] for i in g) or len(g) == 1
    assert any(set(g) == {0, 1, 3, 6} for g in groups)  # the decodes run together


def test_paged_dsa_prefill_chunks_and_decode_equal_full_recompute():
    """The model's one DSA path over the paged pool: chunked prefills and decode steps of rows with different
    pasts (padding inside a step), each step's last logits equal a full forward over the whole sequence,
    with index_topk below the context so the indexer really selects."""
    from openglm.engine.model_runner import ModelRunner
    from openglm.engine.sampling_params import SamplingParams
    from openglm.engine.sequence import Sequence
    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig

    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=16)).eval()
    with torch.no_grad():
        for p in model.parameters():  # attention patterns that are not flat
            if p.dim() > 1:
                p.normal_(0, 0.15)
    runner = ModelRunner(model, num_blocks=40, block_size=4)
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(3, 256, (n,), generator=g).tolist(), SamplingParams()) for n in (13, 5, 9)]
    for i, s in enumerate(seqs):
        s.block_table = [39 - i - 3 * j for j in range(10)]  # scattered blocks, room for 40 tokens each
    worst = 0.0
    for step in range(12):
        counts = [min(4, s.num_uncomputed_tokens) if step < 3 else 1 for s in seqs]  # prefill chunks of 4 first
        counts = [max(c, 1) for c in counts]
        logits = runner.run(seqs, counts)
        for s, c, row in zip(seqs, counts, logits):
            s.num_computed_tokens += c
            with torch.no_grad():
                ref = model(torch.tensor([s.token_ids[:s.num_computed_tokens]])).logits[0, -1]
            worst = max(worst, (row - ref).abs().max().item())
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(int(row.argmax()))
    assert max(s.num_computed_tokens for s in seqs) > 2 * 6  # well past the top-k
    assert worst <= 1e-4
