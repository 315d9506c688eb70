"""Block accounting and the prefix (session) cache, without a model."""

import pytest

from openglm.engine.block_manager import BlockManager
from openglm.engine.config import EngineConfig
from openglm.engine.sampling_params import SamplingParams
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def seq(tokens, max_tokens=8):
    return Sequence(list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens))


def compute_all(bm, s):
    """Pretend the model computed every token of the sequence."""
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(10)), seq(range(100, 105))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 5
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(12))  # three full blocks
    bm.allocate(first)
    compute_all(bm, first)
    assert bm.num_cached_blocks == 3
    bm.free(first)
    assert bm.num_free_blocks == 16  # cached blocks are free (evictable) but still hashed
    again = seq(range(12))
    bm.allocate(again)
    # the last block is not served from the cache so the final token produces logits
    assert again.num_computed_tokens == 8
    assert again.block_table[:2] == first_blocks(bm, range(12))[:2]
    longer = seq(list(range(12)) + [50, 51, 52])
    bm.allocate(longer)
    assert longer.num_computed_tokens == 12
    assert bm.blocks[longer.block_table[0]].ref_count == 2


def first_blocks(bm, tokens):
    from openglm.engine.block_manager import block_hash

    tokens, out, parent = list(tokens), [], None
    for i in range(len(tokens) // bm.block_size):
        parent = block_hash(parent, tokens[i * bm.block_size:(i + 1) * bm.block_size])
        out.append(bm.hash_to_block[parent])
    return out


def test_prefix_hash_is_chained_on_the_parent():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    # same second block, different first block: no hit on the second block
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_ttl_expiry_forgets_idle_blocks():
    clock = Clock()
    bm = BlockManager(num_blocks=8, block_size=4, ttl=10.0, clock=clock)
    a = seq(range(9))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    clock.t = 5.0
    assert bm.expire() == 0 and bm.num_cached_blocks == 2
    b = seq(range(9))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 8  # hit, and the hit refreshes the blocks' last use
    bm.free(b)
    clock.t = 14.0
    assert bm.expire() == 0
    clock.t = 16.0
    assert bm.expire() == 2 and bm.num_cached_blocks == 0
    c = seq(range(9))
    bm.allocate(c)
    assert c.num_computed_tokens == 0


def test_lru_eviction_under_memory_pressure_prefers_old_blocks():
    clock = Clock()
    bm = BlockManager(num_blocks=4, block_size=2, ttl=0, clock=clock)
    old, new = seq([1, 2, 3]), seq([7, 8, 9])
    for t, s in ((1.0, old), (2.0, new)):
        clock.t = t
        bm.allocate(s)
        compute_all(bm, s)
        bm.free(s)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    clock.t = 3.0
    big = seq([20, 21, 22, 23, 24, 25])  # needs 3 blocks: 2 empty + evict 1 cached (the old one)
    bm.allocate(big)
    assert bm.stats["evicted"] == 1
    bm.free(big)
    probe = seq([7, 8, 9])
    bm.allocate(probe)
    assert probe.num_computed_tokens == 2  # the newer prefix survived
    probe_old = seq([1, 2, 3])
    bm.allocate(probe_old)
    assert probe_old.num_computed_tokens == 0  # the older one was evicted


def test_scheduler_preempts_by_recompute_and_returns_blocks():
    cfg = EngineConfig(block_size=2, num_kv_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    bm = BlockManager(cfg.num_kv_blocks, cfg.block_size, enable_prefix_caching=False)
    sched = Scheduler(cfg, bm)
    seqs = [seq([i, i + 1, i + 2], max_tokens=20) for i in (0, 10, 20)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.num_tokens == [3, 3, 3] and bm.num_free_blocks == 0
    preempted = 0
    for step in range(6):
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(99)
        batch = sched.schedule()
        preempted = sched.num_preemptions
        used = sum(len(s.block_table) for s in sched.running)
        assert used == bm.num_used_blocks  # every used block belongs to a running sequence
        assert all(not s.block_table for s in sched.waiting)
    assert preempted >= 1
    victim = next(s for s in seqs if s.num_preemptions)
    assert victim.num_computed_tokens == 0 or victim in sched.running
    for s in list(sched.running) + list(sched.waiting):
        sched.finish(s, "abort")
    assert bm.num_free_blocks == 6 and all(b.ref_count == 0 for b in bm.blocks)


def test_scheduler_chunks_long_prompts_within_the_token_budget():
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=10)
    sched = Scheduler(cfg, BlockManager(64, 4))
    long, short = seq(range(25)), seq(range(3))
    sched.add(long)
    sched.add(short)
    seen = []
    while long.num_computed_tokens < long.num_tokens:
        batch = sched.schedule()
        assert batch.total_tokens <= 10
        seen.append(dict(zip([s.seq_id for s in batch.seqs], batch.num_tokens)))
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed_tokens += n
    assert [d.get(long.seq_id) for d in seen] == [10, 10, 5]
    assert short.seq_id in seen[-1] or short.num_computed_tokens == 3


def test_scheduler_respects_max_num_seqs():
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=100)
    sched = Scheduler(cfg, BlockManager(64, 4))
    for i in range(5):
        sched.add(seq([i] * 5))
    batch = sched.schedule()
    assert len(batch) == 2 and len(sched.waiting) == 3


def test_prompt_larger_than_pool_is_rejected():
    sched = Scheduler(EngineConfig(block_size=4, num_kv_blocks=2), BlockManager(2, 4))
    with pytest.raises(ValueError, match="KV pool"):
        sched.add(seq(range(9)))
