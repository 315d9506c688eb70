"""Which keys each query may see: the attention patterns of the sparse kinds.

Every pattern is defined on token *positions* (0, 1, 2, ... over the real tokens of a sequence), not on cache
slots, so a left- or right-padded batch gives each sequence exactly what it would get alone. The kernels work
on slots; the helpers here translate between the two.

A pattern is used in two steps for one block of queries:
  1. `candidates`: a small superset of the keys the block may see (block-sparse: a contiguous local slice plus
     a few gathered slots), so nothing of size N x N is ever built;
  2. `allowed`: the exact per (query, key) rule on that small set.
A key may appear more than once among the candidates (as a random key of two different query blocks, or as
random and local) only if `allowed` admits each (query, key) pair through exactly one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

KINDS = ("dense", "sliding_window", "local_global_random")


@dataclass(frozen=True)
class SparsePattern:
    """The per-layer attention pattern. Presets are data: see `SparsePattern.lgr()` / `.sliding()`.

    kind:          "dense" (causal), "sliding_window", or "local_global_random" (window + global + random keys).
    window:        local window; query i sees keys j with i - window < j <= i (it counts the query itself).
    global_stride: every position that is a multiple of this is a global key, seen by all later queries.
    n_random:      random earlier keys per query (fixed per `random_block` queries, seeded by `seed`).
    random_block:  queries in the same position block share their random keys (so they are gathered once).
    """
    kind: str = "dense"
    window: int = 512
    global_stride: int = 64
    n_random: int = 64
    random_block: int = 64
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"SparsePattern.kind={self.kind!r}: expected one of {KINDS}")
        for name in ("window", "global_stride", "random_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"SparsePattern.{name}={getattr(self, name)} must be >= 1")
        if self.n_random < 0:
            raise ValueError(f"SparsePattern.n_random={self.n_random} must be >= 0")

    @staticmethod
    def lgr(window=512, global_stride=64, n_random=64, seed=0, random_block=64) -> "SparsePattern":
        return SparsePattern("local_global_random", window, global_stride, n_random, random_block, seed)

    @staticmethod
    def sliding(window: int) -> "SparsePattern":
        return SparsePattern("sliding_window", window=window)


@lru_cache(maxsize=65536)
def _random_positions_cached(seed: int, block: int, n_random: int, random_block: int) -> tuple:
    start = block * random_block  # every query of the block is at a position >= start: strictly earlier keys
    count = min(n_random, start)
    if count == 0:
        return ()
    rng = np.random.default_rng([seed, block])
    return tuple(sorted(int(p) for p in rng.choice(start, size=count, replace=False)))


def random_positions(pattern: SparsePattern, block: int) -> list[int]:
    """The random earlier key positions shared by the queries of position block `block` (sorted, distinct).

    A pure function of (seed, block), so prefill, chunked prefill and every decode step agree."""
    return list(_random_positions_cached(pattern.seed, int(block), pattern.n_random, pattern.random_block))


def key_positions(key_mask: torch.Tensor | None, key_pos: torch.Tensor | None, batch: int, n_keys: int,
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, Tk] (int64, non-decreasing along slots) and validity [B, Tk] (bool) of the cached keys.

    Without `key_pos`, a real token's position is the number of real tokens before it. Padding slots get the
    position of the last real token before them (-1 if none) so `torch.searchsorted` maps a position to the
    slot of its real token."""
    if key_mask is None:
        valid = torch.ones(batch, n_keys, dtype=torch.bool, device=device)
    else:
        if key_mask.shape != (batch, n_keys):
            raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}, expected {(batch, n_keys)}")
        valid = key_mask.to(device=device, dtype=torch.bool)
    if key_pos is None:
        pos = valid.long().cumsum(1) - 1
    else:
        if key_pos.shape != (batch, n_keys):
            raise ValueError(f"key_pos has shape {tuple(key_pos.shape)}, expected {(batch, n_keys)}")
        pos = torch.where(valid, key_pos.to(device=device, dtype=torch.long),
                          torch.full_like(valid, -1, dtype=torch.long))
        pos = pos.cummax(1).values
    return pos, valid


@dataclass
class Candidates:
    """Keys one query block may see: slots [lo, hi) (a slice, no copy) plus gathered `slots` [B, Kg]
    (-1 = empty) with their `tags` (-1 = local/global entry, r >= 0 = random key of position block r)."""
    lo: int
    hi: int
    slots: torch.Tensor | None = None
    tags: torch.Tensor | None = None


def _window_start(pattern: SparsePattern, kpos, qpos, q_valid) -> int:
    """First slot any query of the block could see through its local window (same for the whole batch)."""
    if pattern.kind == "dense":
        return 0
    big = torch.iinfo(torch.long).max
    qmin = torch.where(q_valid, qpos, torch.full_like(qpos, big)).min(1).values  # [B]
    first = (qmin - pattern.window + 1).clamp(min=0).unsqueeze(1)
    lo = torch.searchsorted(kpos, first).min()  # left: the real slot of that position
    return int(lo)


def candidates(pattern: SparsePattern, kpos, valid, q_start: int, q_end: int) -> Candidates:
    """Candidates for the query slots [q_start, q_end) (slots in the key/cache axis)."""
    qpos, q_valid = kpos[:, q_start:q_end], valid[:, q_start:q_end]
    lo = min(_window_start(pattern, kpos, qpos, q_valid), q_end)  # a block of padding only: empty slice
    cand = Candidates(lo=lo, hi=q_end)
    if pattern.kind != "local_global_random":
        return cand
    batch = kpos.shape[0]
    # [B] positions that live in slots < lo: the global keys among them are gathered, the rest are in the slice.
    before = kpos[:, lo - 1] + 1 if lo > 0 else torch.zeros(batch, dtype=torch.long, device=kpos.device)
    stride = pattern.global_stride
    n_glob = int(((before + stride - 1) // stride).max())
    gpos = torch.arange(n_glob, device=kpos.device) * stride
    gpos = gpos.unsqueeze(0).expand(batch, n_glob)
    gkeep = gpos < before.unsqueeze(1)
    parts_pos, parts_keep, parts_tag = [gpos], [gkeep], [torch.full_like(gpos, -1)]
    if pattern.n_random:
        blocks = qpos.clamp(min=0) // pattern.random_block
        for r in torch.unique(blocks[q_valid]).tolist():
            rpos = torch.tensor(random_positions(pattern, r), dtype=torch.long, device=kpos.device)
            if rpos.numel() == 0:
                continue
            rpos = rpos.unsqueeze(0).expand(batch, -1)
            parts_pos.append(rpos)
            # Kept even when inside the slice: there only `allowed` knows which queries' windows cover them.
            parts_keep.append(torch.ones_like(rpos, dtype=torch.bool))
            parts_tag.append(torch.full_like(rpos, r))
    pos, keep, tag = torch.cat(parts_pos, 1), torch.cat(parts_keep, 1), torch.cat(parts_tag, 1)
    slots = torch.searchsorted(kpos, pos.contiguous()).clamp(max=kpos.shape[1] - 1)
    keep &= kpos.gather(1, slots) == pos  # explicit key_pos may have gaps: drop positions with no token
    cand.slots = torch.where(keep, slots, torch.full_like(slots, -1))
    cand.tags = tag
    return cand


def allowed(pattern: SparsePattern, qpos, q_valid, kpos, k_valid, k_tag=None) -> torch.Tensor:
    """Exact rule: bool [B, Tq, Tk] for query positions [B, Tq] against key positions [B, Tk]."""
    qp, kp = qpos.unsqueeze(2), kpos.unsqueeze(1)
    ok = (kp <= qp) & k_valid.unsqueeze(1) & q_valid.unsqueeze(2)
    if pattern.kind == "dense":
        return ok
    local = (qp - kp) < pattern.window
    if pattern.kind == "sliding_window":
        return ok & local
    near = local | (kp % pattern.global_stride == 0)
    if k_tag is None:
        return ok & near
    qblock = (qpos.clamp(min=0) // pattern.random_block).unsqueeze(2)
    tag = k_tag.unsqueeze(1)
    return ok & torch.where(tag < 0, near, (tag == qblock) & ~near)


def dense_mask(pattern: SparsePattern, kpos, valid, n_queries: int) -> torch.Tensor:
    """The full [B, Tq, Tk] mask of a pattern (for references and small inputs only: it is N x N)."""
    n_keys = kpos.shape[1]
    qpos, q_valid = kpos[:, n_keys - n_queries:], valid[:, n_keys - n_queries:]
    mask = allowed(pattern, qpos, q_valid, kpos, valid)
    if pattern.kind == "local_global_random" and pattern.n_random:
        for b in range(kpos.shape[0]):
            for i in range(n_queries):
                if not q_valid[b, i]:
                    continue
                rpos = random_positions(pattern, int(qpos[b, i]) // pattern.random_block)
                hit = torch.isin(kpos[b], torch.tensor(rpos, dtype=torch.long)) & valid[b]
                mask[b, i] |= hit & (kpos[b] <= qpos[b, i])
    return mask


def plain_bias(pattern: SparsePattern, q_start: int, q_end: int, cand: Candidates, cache: dict) -> torch.Tensor:
    """Additive mask [1, Q, K] for the common case without padding (position == slot), built cheaply.

    The local slice's band depends only on the block's shape and offset, so interior blocks reuse one cached
    template; global keys gathered for the block are all visible (they precede every query of the block);
    only the few random entries need the per-pair rule."""
    nq, width = q_end - q_start, cand.hi - cand.lo
    key = (q_start - cand.lo, nq, width, cand.lo % pattern.global_stride)
    local = cache.get(key)
    if local is None:
        qpos = torch.arange(q_start, q_end).unsqueeze(0)
        kpos = torch.arange(cand.lo, cand.hi).unsqueeze(0)
        ok = allowed(pattern, qpos, torch.ones_like(qpos, dtype=torch.bool),
                     kpos, torch.ones_like(kpos, dtype=torch.bool))
        local = torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))
        cache[key] = local
    if cand.slots is None or cand.slots.shape[1] == 0:
        return local
    glob = cand.tags[0] < 0
    n_glob = int(glob.sum())
    rand = torch.zeros(1, nq, cand.slots.shape[1] - n_glob)
    if rand.shape[-1]:
        qpos = torch.arange(q_start, q_end).unsqueeze(0)
        kpos, tags = cand.slots[:1, n_glob:], cand.tags[:1, n_glob:]  # rows are identical without padding
        ok = allowed(pattern, qpos, torch.ones_like(qpos, dtype=torch.bool), kpos, kpos >= 0, tags)
        rand.masked_fill_(~ok, float("-inf"))
    return torch.cat([local, torch.zeros(1, nq, n_glob), rand], -1)
