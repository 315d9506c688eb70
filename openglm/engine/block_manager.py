"""Paged KV block accounting: a free pool, per-sequence block tables, and the prefix (session) cache.

A full block is identified by a hash of its tokens chained on its parent block's hash, so equal hashes
mean equal prefixes. When its last user finishes, a hashed block is not wiped: it stays reusable
("cached") until it has been idle longer than the TTL, or until the pool needs it (LRU eviction).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from openglm.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple = field(default_factory=tuple)
    last_used: float = 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 ttl: float = 600.0, clock=time.monotonic):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ttl = ttl
        self.clock = clock
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but hashed, least recently used first
        self.hash_to_block: dict[bytes, int] = {}
        self.seq_hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its committed full blocks
        self.stats = {"prefix_queries": 0, "prefix_hits": 0, "evicted": 0, "expired": 0}

    # ---- pool state -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -----------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is never served
        from the cache, so at least one token is computed and produces logits."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            h = block_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens):
                break
            hits.append(bid)
            parent = h
        return hits

    def expire(self) -> int:
        """Forget idle cached blocks older than the TTL (the session cache's expiry)."""
        if self.ttl <= 0:
            return 0
        now, n = self.clock(), 0
        while self.evictable:
            bid = next(iter(self.evictable))
            if now - self.blocks[bid].last_used < self.ttl:
                break  # LRU order: everything after is younger
            self._empty(bid)
            n += 1
        self.stats["expired"] += n
        return n

    def _empty(self, bid: int) -> None:
        """Return a free block to the empty pool, forgetting whatever it held."""
        self.evictable.pop(bid, None)
        self._forget(bid)
        self.empty.append(bid)

    def _forget(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()

    def _take_free(self) -> int:
        if self.empty:
            bid = self.empty.popleft()
        else:  # evict the least recently used cached block
            bid, _ = self.evictable.popitem(last=False)
            self._forget(bid)
            self.stats["evicted"] += 1
        block = self.blocks[bid]
        assert block.ref_count == 0, f"block {bid} taken from the pool while in use"
        block.ref_count = 1
        return bid

    # ---- sequences --------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits that leave the free pool
        return self.blocks_needed(seq.num_tokens) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq} already holds blocks"
        hits = self._prefix_hits(seq)
        now = self.clock()
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self.evictable.pop(bid)
            block.ref_count += 1
            block.last_used = now
        self.stats["prefix_queries"] += (seq.num_tokens - 1) // self.block_size
        self.stats["prefix_hits"] += len(hits)
        seq.block_table = list(hits)
        self.seq_hashes[seq.seq_id] = [self.blocks[b].hash for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_free())

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for the next `num_new_tokens` KV entries of a running sequence."""
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Hash the sequence's newly completed full blocks so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        now = self.clock()
        while (len(hashes) + 1) * self.block_size <= seq.num_computed_tokens:
            i = len(hashes)
            tokens = seq.block_tokens(i, self.block_size)
            h = block_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            bid = seq.block_table[i]
            block = self.blocks[bid]
            block.last_used = now
            if h not in self.hash_to_block:  # first writer wins; a duplicate stays private
                block.hash, block.token_ids = h, tuple(tokens)
                self.hash_to_block[h] = bid

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finish, abort or preemption). Tail blocks go first so that,
        under LRU eviction, a shared prefix outlives the private suffixes built on it."""
        now = self.clock()
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            block.last_used = now
            if block.ref_count == 0:
                if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
                    self.evictable[bid] = None
                else:
                    self._empty(bid)
        seq.block_table = []
        self.seq_hashes.pop(seq.seq_id, None)
