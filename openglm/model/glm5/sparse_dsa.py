"""DeepSeek sparse attention (DSA) by gathering: each query reads only its top-k keys.

The lightning indexer scores every earlier key for each query (quadratic by design, but a few small heads),
one query block at a time so its memory is O(block x N); attention then reads only the k selected cache
entries per query, so attention memory and FLOPs are O(N x k) instead of the dense-mask formulation's O(N^2).
For MLA, pass the absorbed form (`sparse.mla_absorbed`): the gathered entries are the small latents.

Inference reads the selected rows in place instead of copying them. Where a C compiler is available, two small
native kernels (`dsa_kernels.c`, compiled on first use by `native.py`) do the work torch ops do badly: the
indexer's head sum and per-row top-k, and the scores and weighted value sums of the selected (query, key) pairs,
key-major. Without one the same steps run as torch ops: a sampled matrix product (`torch.sparse.sampled_addmm`
over a CSR pattern) for the scores and `F.embedding_bag` for the value sums. Either way the attention stays
fp32, so the result equals the dense-mask formulation. `score_dtype=torch.bfloat16` runs the indexer's matmul in
bf16 (the real DSA indexer runs in FP8); that may change which keys win near-ties, so it is an opt-in.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from openglm.model import gpu
from openglm.model.native import check, dsa_kernels, ptr
from openglm.model.sparse import DEFAULT_BUDGET, check_qkv, needs_grad
from openglm.model.sparse_patterns import SparsePattern, allowed, key_positions

_CAUSAL = SparsePattern("dense")
# Bytes per selected (query, key) pair while a chunk is attended: slots, the key-major order and its inverse,
# the CSR pattern and the copies sampled_addmm makes of it, one head's scores and weights, embedding_bag's
# bookkeeping (~128 bytes in all).
PAIR_BYTES = 128
# The native kernels need 16 bytes per pair (the slot, its query, its score). Their chunks hold up to a quarter
# of the budget: more queries per chunk amortise streaming each head's keys and values once per chunk (1,024
# queries cost ~20% less per pair than 256), but every query costs k x 16 bytes (512 queries at k = 2,048).
NATIVE_PAIR_BYTES = 16
SCORE_DTYPES = (torch.float32, torch.bfloat16)
# A block of at most this many queries per sequence (decode steps) attends by one batched gather + bmm: the
# key-major passes cost a few calls per sequence and head, more than they save on so few pairs.
FEW_QUERIES = 8
SMALL_ROWS = 64  # a gather of at most this many (sequence, query) rows without autograd computes in fp32
GATHER_BLOCK_BYTES = 4 << 20  # gathered rows of one block: small blocks stay in cache and reuse one buffer


def _pair_block(n_top: int, n_queries: int, budget_bytes: int, native: bool) -> int:
    """Queries per attention chunk of selected pairs."""
    if native:
        return _block(NATIVE_PAIR_BYTES * n_top, n_queries, budget_bytes // 4)
    return _block(PAIR_BYTES * n_top, n_queries, budget_bytes)


def _block(bytes_per_query: int, n_queries: int, budget_bytes: int) -> int:
    block = 1
    while block < n_queries and 2 * block * bytes_per_query <= budget_bytes:
        block *= 2
    return min(block, n_queries)


def _check_indexer(index_q, index_k, weights, score_dtype):
    b, tq, hi, di = index_q.shape
    tk = index_k.shape[1]
    if index_k.shape != (b, tk, di) or weights.shape != (b, tq, hi):
        raise ValueError(f"indexer shapes: q {tuple(index_q.shape)}, k {tuple(index_k.shape)}, "
                         f"weights {tuple(weights.shape)}")
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype={score_dtype}: expected one of {SCORE_DTYPES}")


def _check_scale(scale: float) -> float:
    if not scale > 0:  # index_scores applies it after the relu, which only a positive scale commutes with
        raise ValueError(f"indexer scale must be positive, got {scale}")
    return scale


def index_scores(index_q, index_k_t, weights, scale: float, score_dtype=torch.float32, scratch=None):
    """Indexer scores [B, Q, Tk] (in score_dtype) of one query block: sum_h w[h] * relu(scale * q[h] . k).

    index_q [B, Q, Hi, Di], index_k_t [B, Di, Tk] (already in score_dtype), weights [B, Q, Hi].
    With a `Scratch`, the intermediates (and the result) live in its reused buffers."""
    b, nq, hi, di = index_q.shape
    tk = index_k_t.shape[-1]
    scratch = scratch or Scratch(index_q.device)
    q = index_q.reshape(b, nq * hi, di).to(score_dtype)
    # one [Q*Hi, Di] x [Di, Tk] product per sequence; the scale is applied after the relu
    sc = torch.bmm(q, index_k_t, out=scratch.take("heads", (b, nq * hi, tk), score_dtype)).relu_()
    w = weights.to(score_dtype).unsqueeze(2) * scale  # relu(scale * x) = scale * relu(x): scale > 0
    out = torch.matmul(w, sc.view(b, nq, hi, tk), out=scratch.take("summed", (b, nq, 1, tk), score_dtype))
    return out.view(b, nq, tk)


class Scratch:
    """Reused flat buffers for per-block intermediates.

    A block's scores cover every key up to its last query, so their size grows block after block; fresh
    allocations of ever new sizes are what glibc's heap reuses worst (before this, the process's peak memory
    at 32K was 2.6x fused SDPA's while far less was live). A buffer is allocated once, at the largest size
    the caller announces (`reserve`), and each block takes a view of its front."""

    def __init__(self, device=None):
        self._bufs: dict[str, torch.Tensor] = {}
        self._sizes: dict[str, int] = {}
        self.device = device

    def reserve(self, name: str, numel: int) -> None:
        self._sizes[name] = max(self._sizes.get(name, 0), numel)

    def take(self, name: str, shape, dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(max(n, self._sizes.get(name, 0)), dtype=dtype, device=self.device)
        return buf[:n].view(shape)


KEY_TILE = 2048  # bf16 indexer blocks score a multiple of this many keys (see _Selector)
PREFILTER_STRIDE = 16  # the threshold sample reads every 16th score of a row
PREFILTER_SLACK = 1.25  # ... and keeps 1.25x its share of the top-k (~3 sigma: the threshold rarely overshoots)
PREFILTER_MIN_ROW = 3  # rows shorter than 3x the sample's reach are cheaper to top-k whole (the C has it too)
NATIVE_KEY_TILE = 2 * KEY_TILE  # keys per indexer matmul on the native path: its bf16 output stays in L2


def _top_slots(sc, n_top: int):
    """Top n_top slots per row of masked scores [B, Q, Tk] as [B, Q, n_top] long (-1 where -inf), each row
    in ascending slot order (cache-friendly reads; the attention needs no sort).

    Long rows are prefiltered (torch.topk costs ~10 ns per element here): a threshold from a strided sample
    of the row keeps ~1.25 k candidates, the exact k-th best score is found among those, and the row's top-k
    are the candidates at or above it. Rows the shortcut cannot settle exactly (the sample overshot, too few
    visible keys) take the plain top-k, so the result is always a top-k set."""
    b, nq, tk = sc.shape
    n_top = min(n_top, tk)
    rows = sc.reshape(b * nq, tk)
    n_sample = int(PREFILTER_SLACK * n_top / PREFILTER_STRIDE)
    if n_sample < 1 or tk < PREFILTER_MIN_ROW * PREFILTER_STRIDE * n_sample:
        return topk_slots(rows, n_top).view(b, nq, n_top)
    out = torch.empty(b * nq, n_top, dtype=torch.long, device=sc.device)
    thr = rows[:, ::PREFILTER_STRIDE].topk(n_sample, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    thr.masked_fill_(thr == float("-inf"), float("inf"))  # too few visible keys: no candidates, plain path
    settled = _prefiltered_top(rows, thr, n_top, out)
    if not bool(settled.all()):
        out[~settled] = topk_slots(rows[~settled], n_top)
    return out.view(b, nq, n_top)


def _prefiltered_top(rows, thr, n_top: int, out) -> torch.Tensor:
    """Writes the top n_top slots of each row with enough candidates (scores >= thr) into `out`; returns
    which rows those were. Slots tied at the k-th score fill the last places in slot order (bf16 scores tie
    often; torch.topk also picks some of the tied ones)."""
    n_rows, width = rows.shape
    flat = (rows >= thr).view(-1).nonzero().squeeze(1)  # row-major: a row's candidates are contiguous, in slot order
    r = flat // width
    count = torch.bincount(r, minlength=n_rows)
    settled = count >= n_top
    if not bool(settled.any()):
        return settled
    vals = rows.view(-1).index_select(0, flat)
    start = count.cumsum(0) - count
    padded = rows.new_full((n_rows, int(count.max())), float("-inf"))
    pos = torch.arange(flat.numel(), device=rows.device) - start.repeat_interleave(count)  # place in its row
    padded.view(-1).index_put_((r * padded.shape[1] + pos,), vals)
    # per candidate (candidates are grouped by row): its row's k-th best score
    kth = padded.topk(n_top, dim=-1, sorted=False).values.amin(-1).repeat_interleave(count)
    above, tied = vals > kth, vals == kth
    room = n_top - torch.bincount(r[above], minlength=n_rows)  # places left for slots tied at the k-th score
    tied_before = tied.cumsum(0) - tied.long()  # tied candidates before this one, over all rows
    rank = tied_before - tied_before[start.clamp(max=flat.numel() - 1)].repeat_interleave(count)  # ... in its row
    chosen = (above | (tied & (rank < room.repeat_interleave(count)))) & settled.repeat_interleave(count)
    out[settled] = (flat - r * width).masked_select(chosen).view(-1, n_top)
    return settled


def topk_slots(rows, n_top: int):
    vals, idx = rows.topk(n_top, dim=-1, sorted=False)  # a set: sorted by slot below, not by score
    return idx.masked_fill_(vals == float("-inf"), -1).sort(-1).values


def indexer_topk(index_q, index_k, weights, topk: int, *, scale: float | None = None,
                 key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET,
                 score_dtype=torch.float32) -> torch.Tensor:
    """Top-k key slots per query, [B, Tq, min(topk, Tk)] int64, -1 where fewer keys are visible.

    index_q [B, Tq, Hi, Di], index_k [B, Tk, Di], weights [B, Tq, Hi] (already scaled as the model wants).
    score(i, j) = sum_h weights[i, h] * relu(scale * index_q[i, h] . index_k[j]) over causal, non-padding j,
    as in transformers' GlmMoeDsaIndexer."""
    _check_indexer(index_q, index_k, weights, score_dtype)
    b, tq, hi, di = index_q.shape
    tk = index_k.shape[1]
    select = _Selector(index_k, key_mask, key_pos, _check_scale(di ** -0.5 if scale is None else scale),
                       topk, score_dtype, _block(4 * (hi + 2) * tk, tq, budget_bytes), hi)
    out = torch.full((b, tq, select.n_top), -1, dtype=torch.long, device=index_q.device)
    past = tk - tq
    for s in range(0, tq, select.block):
        e = min(tq, s + select.block)
        idx = select(index_q[:, s:e], weights[:, s:e], past + s, past + e)
        out[:, s:e, :idx.shape[-1]] = idx
    return out


class _Selector:
    """The indexer's top-k for one query block at a time: score the block's queries against every key up to
    its last one, hide the invisible keys, keep the top-k. Buffers are reused from block to block. Selection
    is not differentiable (the indexer's inputs are detached): it picks keys, it does not weight them."""

    def __init__(self, index_k, key_mask, key_pos, scale: float, topk: int, score_dtype, block: int, heads: int):
        b, tk = index_k.shape[:2]
        # oneDNN (which runs the bf16 matmuls) caches a compiled kernel per new shape: scoring each block over
        # exactly its visible keys made ~1 MiB of cache per block (0.5 GiB at 32K). In bf16 the scored range
        # is rounded up to KEY_TILE keys (zero keys, masked), so only Tk / KEY_TILE shapes ever occur.
        self.tile = KEY_TILE if score_dtype != torch.float32 else 1
        self.kt = index_k.transpose(1, 2).to(score_dtype)  # [B, Di, Tk]: one cast for all blocks, a view in fp32
        self.scale, self.score_dtype, self.block, self.n_top = scale, score_dtype, block, min(topk, tk)
        # Without padding or explicit positions, slot order is causal order: only a triangle is hidden.
        self.plain = key_mask is None and key_pos is None
        self.kpos = self.valid = None
        if not self.plain:
            self.kpos, self.valid = key_positions(key_mask, key_pos, b, tk, device=index_k.device)
        self.scratch = Scratch(index_k.device)
        self.lib = dsa_kernels() if index_k.device.type == "cpu" else None  # the C kernels read CPU memory
        self.padded = self.tiles = None  # built on the first block that needs them (never for a decode step)
        width = tk + (-tk % self.tile)  # the scored range, in whole tiles
        if self.lib is not None:  # fp32 score rows, and per-head scores of one key tile
            self.key_tile = min(NATIVE_KEY_TILE, width)
            sizes = {"rows": b * block * width, "work": 4 * width, "heads": b * block * heads * self.key_tile}
        else:
            sizes = {"heads": b * block * heads * width, "summed": b * block * width}
        for name, numel in sizes.items():
            self.scratch.reserve(name, numel)

    def __call__(self, index_q, weights, qs: int, qe: int) -> torch.Tensor:
        """Key slots [B, qe - qs, <= n_top] of the query slots [qs, qe), ascending per row, -1 = none."""
        if qe <= self.n_top:  # every visible key fits: no scoring, no top-k
            ok = self._visible(qs, qe)
            return torch.arange(qe, device=ok.device).expand(ok.shape).masked_fill(~ok, -1)
        scored = -(-qe // self.tile) * self.tile
        if self.lib is not None:
            return self._native_top(self.lib, index_q, weights, qs, qe, scored)
        sc = index_scores(index_q, self._keys_t(qe, scored), weights, self.scale, self.score_dtype, self.scratch)
        sc[:, :, qe:] = float("-inf")  # padding keys and keys after the block's last query
        if self.plain:
            future = torch.ones(qe - qs, qe - qs, dtype=torch.bool, device=sc.device).triu_(1)
            sc[:, :, qs:qe].masked_fill_(future, float("-inf"))
        else:
            sc[:, :, :qe].masked_fill_(~self._visible(qs, qe), float("-inf"))
        out = _top_slots(sc, self.n_top)
        # Rows whose k-th score is tied beyond the places left: torch.topk's choice over the whole key range.
        ok = out >= 0
        kth = sc.gather(-1, out.clamp(min=0)).masked_fill_(~ok, float("inf")).amin(-1, keepdim=True)
        ambiguous = ((sc == kth).sum(-1) > ((sc.gather(-1, out.clamp(min=0)) == kth) & ok).sum(-1)) & ok.all(-1)
        if bool(ambiguous.any()):
            out[ambiguous] = self._tie_break(sc[ambiguous])
        return out

    def _keys_t(self, qe: int, scored: int) -> torch.Tensor:
        """The transposed keys [B, Di, scored] of the torch-op path: a view of the first qe keys when no tile
        rounding is needed (fp32: a decode step copies nothing), else of the zero-padded copy."""
        if scored == qe:
            return self.kt[:, :, :qe]
        if self.padded is None:
            self.padded = F.pad(self.kt, (0, -self.kt.shape[-1] % self.tile))
        return self.padded[:, :, :scored]

    def _native_top(self, lib, index_q, weights, qs: int, qe: int, scored: int) -> torch.Tensor:
        """The same selection in C. The matmul stays oneDNN's, but one key tile at a time: a tile's per-head
        scores ([Q*Hi, key_tile]) stay in cache while the C sums them into each row's scores (fp32); then each
        row is masked and top-k'd in C (one pass for the threshold sample, one to keep candidates). A block of
        few queries (a decode step) scores its keys in one matmul over the key view: no tiles, no copy."""
        b, nq, hi, di = index_q.shape
        rows_n = b * nq  # after the matmul every (sequence, query) row is independent: one C call for all
        q = index_q.reshape(b, nq * hi, di).to(self.score_dtype)
        w = (weights.float() * self.scale).contiguous()  # relu(scale * x) = scale * relu(x): scale > 0
        rows = self.scratch.take("rows", (rows_n, scored), torch.float32)
        if self.plain:  # query slot t sees the slots up to t
            n_keys = torch.full((rows_n,), qe) if nq == 1 else torch.arange(qs + 1, qe + 1).repeat(b)
            visible = None
        else:
            n_keys, visible = torch.full((rows_n,), qe), self._visible(qs, qe).to(torch.uint8).contiguous()
        is_bf16 = int(self.score_dtype == torch.bfloat16)
        if nq <= FEW_QUERIES:
            heads = torch.bmm(q, self.kt[:, :, :qe])  # [B, nq * Hi, qe]
            check(lib.dsa_head_sum(ptr(heads), is_bf16, rows_n, hi, qe, ptr(w), ptr(n_keys), 0, ptr(rows), scored),
                  "dsa_head_sum")
        else:
            t = self.key_tile
            tiles = self._tiles()
            heads = self.scratch.take("heads", (b, nq * hi, t), self.score_dtype)
            for c0 in range(0, scored, t):  # keys past n_keys (the tile's padding among them) are not read
                torch.bmm(q, tiles[:, c0 // t], out=heads)
                check(lib.dsa_head_sum(ptr(heads), is_bf16, rows_n, hi, t, ptr(w), ptr(n_keys), c0, ptr(rows), scored),
                      "dsa_head_sum")
        out = torch.empty(b, nq, self.n_top, dtype=torch.long, device=index_q.device)
        work = self.scratch.take("work", (4 * scored,), torch.float32)
        tied = torch.empty(rows_n, dtype=torch.uint8)
        n_sample = int(PREFILTER_SLACK * self.n_top / PREFILTER_STRIDE)
        if check(lib.dsa_rows_topk(ptr(rows), scored, rows_n, ptr(n_keys), None if visible is None else ptr(visible),
                                   qe, self.n_top, PREFILTER_STRIDE, n_sample, ptr(out), self.n_top, ptr(work),
                                   ptr(tied)), "dsa_rows_topk"):
            r = tied.bool().nonzero().squeeze(1)
            beyond = torch.arange(scored)[None, :] >= n_keys[r, None]  # not written by the C: invisible
            out.view(rows_n, -1)[r] = self._tie_break(rows[r].masked_fill(beyond, float("-inf")))
        return out

    def _tie_break(self, sc: torch.Tensor) -> torch.Tensor:
        """Slots of score rows sc [R, <= Tk] (-inf = invisible) whose k-th score is tied beyond the places left:
        which tied keys win is then arbitrary, so the choice is torch.topk's over the whole key range (the
        reference's, transformers', formulation: one row of Tk scores, -inf where invisible), so that a model
        selects what transformers selects even with exact ties (relu zeros are common with few index heads)."""
        full = F.pad(sc, (0, self.kt.shape[-1] - sc.shape[-1]), value=float("-inf"))
        return topk_slots(full, self.n_top)

    def _tiles(self) -> torch.Tensor:
        """The keys cut into [B, tiles, Di, key_tile] (zero keys pad the last): each tile's matmul reads a
        contiguous matrix (~25% faster than a strided slice) of one shape (one oneDNN kernel)."""
        if self.tiles is None:
            b, di, tk = self.kt.shape
            t = self.key_tile
            kt = F.pad(self.kt, (0, -tk % t))
            self.tiles = kt.view(b, di, -1, t).transpose(1, 2).contiguous()
        return self.tiles

    def _visible(self, qs: int, qe: int) -> torch.Tensor:
        """bool [B, qe - qs, qe]: which of the first qe slots each query slot in [qs, qe) may see."""
        if self.plain:
            ok = (torch.arange(qe, device=self.kt.device)[None, :]
                  <= torch.arange(qs, qe, device=self.kt.device)[:, None])
            return ok.expand(self.kt.shape[0], -1, -1)
        kpos, valid = self.kpos, self.valid
        return allowed(_CAUSAL, kpos[:, qs:qe], valid[:, qs:qe], kpos[:, :qe], valid[:, :qe])


def gather_attention(q, k, v, topk_idx, *, scale: float | None = None,
                     budget_bytes: int = DEFAULT_BUDGET, sorted_slots: bool = False) -> torch.Tensor:
    """Attention of each query over its own key slots topk_idx [B, Tq, K] (-1 = unused); [B, H, Tq, Dv].

    sorted_slots: the caller promises each row's slots ascend (-1s anywhere), which saves a sort.
    v may be a view of k's leading channels (MLA's latent is both key and value): its rows are then gathered
    once. q, k, v may be strided views (the model passes its [B, T, H, D] layout transposed, and cache views).

    O(Tq x K) memory and FLOPs. Inference with fp32 q and k and more than FEW_QUERIES queries reads the
    selected rows in place, key-major (`_native_attend` in C, else `_sparse_attend`; v fp32 or bf16: the value
    sum then runs in bf16). Autograd (training), reduced-precision q / k, and few queries (decode steps: one
    batched gather beats per-sequence, per-head calls) gather the rows per query block and score them with
    differentiable matmuls (`_gathered_attend`)."""
    check_qkv(q, k, v)
    b, h, tq, dk = q.shape
    tk = k.shape[2]
    if topk_idx.shape[:2] != (b, tq):
        raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, expected ({b}, {tq}, K)")
    lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist() if topk_idx.numel() else (0, -1)
    if hi >= tk:  # the native kernels would read past the cache
        raise IndexError(f"topk_idx holds slot {hi}, but there are only {tk} keys")
    if gpu.wanted(q):  # CUDA: the Triton sparse MLA kernel (model/gpu.py)
        return gpu.gather_attention(q, k, v, topk_idx, dk ** -0.5 if scale is None else scale)
    return _attend_slots(q, k, v, topk_idx, dk ** -0.5 if scale is None else scale, budget_bytes, sorted_slots,
                         needs_grad(q, k, v),
                         complete=lo >= 0)


def _attend_slots(q, k, v, topk_idx, scale: float, budget_bytes: int, sorted_slots: bool, grad: bool,
                  complete: bool):
    """gather_attention without its checks, for slots this module selected. complete: no slot is -1 anywhere
    (a decode step without padding): nothing to mask or zero. grad: autograd records q, k or v (`needs_grad`)."""
    b, h, tq, dk = q.shape
    tk = k.shape[2]
    # A CSR row cannot hold more entries than the matrix has columns (padding entries repeat slot 0).
    if (grad or tq <= FEW_QUERIES or q.dtype != torch.float32 or k.dtype != torch.float32
            or topk_idx.shape[-1] > tk or q.device.type != "cpu"):  # (the key-major paths are CPU kernels)
        out = _gathered_attend(q, k, v, topk_idx, scale, budget_bytes, grad, complete)
        if complete:
            return out
    else:
        out = _output_like(q, v.shape[-1])
        n_top = max(1, topk_idx.shape[-1])
        lib = dsa_kernels() if v.dtype == torch.float32 else None
        block = _pair_block(n_top, tq, budget_bytes, lib is not None)
        for s in range(0, tq, block):
            e = min(tq, s + block)
            idx = topk_idx[:, s:e].long()
            ok = idx >= 0
            for i in range(b):
                if lib is not None:  # key-major in C (no sort needed: the pairs are ordered by key there)
                    _native_attend(lib, q[i, :, s:e], k[i], v[i], idx[i], scale, out[i, :, s:e])
                else:
                    out[i, :, s:e] = _sparse_attend(q[i, :, s:e], k[i], v[i], idx[i], ok[i], scale, sorted_slots)
    return out.masked_fill_(~(topk_idx >= 0).any(-1)[:, None, :, None], 0.0)


def _sparse_attend(q, k, v, idx, ok, scale: float, sorted_slots: bool = False):
    """One sequence: q [H, Q, Dk], k [Hkv, Tk, Dk], v [Hkv, Tk, Dv], idx/ok [Q, K] -> [H, Q, Dv].

    The scores of the selected (query, key) pairs are computed key-major: the pairs are ordered by key, so
    each key row is read once, in order, by every query of the block that selected it (query rows stay in
    cache). Query-major reads jump across the whole key matrix; at 64K keys one head's keys no longer fit in
    cache and that costs ~2x. The values are then summed per query in slot order. Unused entries read slot 0
    with weight 0; queries with no visible key come out NaN (the caller zeroes them)."""
    h, nq, _ = q.shape
    hkv, tk = k.shape[:2]
    n_top = idx.shape[-1]
    all_ok = bool(ok.all())  # the usual case past the first k positions: nothing to mask
    if not all_ok:
        idx = idx.masked_fill(~ok, 0)
    if not sorted_slots:
        idx, order = idx.sort(-1)
        ok = ok.gather(-1, order)
    cols = idx.reshape(-1)
    by_key = torch.argsort(cols, stable=True)  # pair positions in key order
    to_query_major = torch.empty_like(by_key)
    to_query_major[by_key] = torch.arange(by_key.numel(), device=q.device)
    key_start = torch.zeros(tk + 1, dtype=torch.long, device=q.device)
    torch.cumsum(torch.bincount(cols, minlength=tk), 0, out=key_start[1:])
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the two ops used here are stable
        warnings.simplefilter("ignore")
        pattern = torch.sparse_csr_tensor(key_start, by_key // n_top, q.new_zeros(by_key.numel()), size=(tk, nq))
    offsets = torch.arange(0, nq * n_top, n_top, device=q.device)
    out = q.new_empty(h, nq, v.shape[-1])
    g = h // hkv
    for j in range(h):
        kh, vh = k[j // g], v[j // g]
        # [Tk, Dk] x [Dk, Q] sampled at the pattern; q[j].t() keeps each query's row contiguous
        sc = torch.sparse.sampled_addmm(pattern, kh, q[j].t(), beta=0.0, alpha=scale).values()
        sc = sc.index_select(0, to_query_major)
        sc = sc.view(nq, n_top) if all_ok else sc.view(nq, n_top).masked_fill_(~ok, float("-inf"))
        p = torch.softmax(sc, -1)
        out[j] = F.embedding_bag(cols, vh, offsets, mode="sum", per_sample_weights=p.view(-1).to(vh.dtype))
    return out


def _native_attend(lib, q, k, v, idx, scale: float, out) -> None:
    """One sequence in C: q [H, Q, Dk], k [Hkv, Tk, Dk], v [Hkv, Tk, Dv], idx [Q, K] (-1 = unused) -> out
    [H, Q, Dv] (a view; rows with no selected key come out NaN, the caller zeroes them).

    The selected pairs are ordered by key once; then per head each key row is read once, in order, and scored
    against the queries that selected it (their rows stay in cache), and the weighted value rows are added
    to those queries' outputs the same way. The softmax runs between the two, as torch ops over the pairs."""
    q, k, v, idx = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, idx.contiguous()))
    h, nq, dk = q.shape
    hkv, tk = k.shape[:2]
    key_start = torch.empty(tk + 1, dtype=torch.long)
    pair_q = torch.empty(idx.numel(), dtype=torch.int32)
    n = check(lib.dsa_pairs_by_key(ptr(idx), nq, idx.shape[1], tk, ptr(key_start), ptr(pair_q)), "dsa_pairs_by_key")
    pair_q = pair_q[:n]
    sc, rowmax, rowsum = q.new_empty(n), q.new_empty(nq), q.new_empty(nq)
    o = out if out.stride(-1) == 1 else q.new_empty(out.shape)
    g = h // hkv
    for j in range(h):
        kh, vh = k[j // g], v[j // g]
        check(lib.dsa_pair_scores(ptr(q[j]), q.stride(1), ptr(kh), kh.stride(0), tk, dk, scale, ptr(key_start),
                                  ptr(pair_q), ptr(sc), ptr(rowmax), nq), "dsa_pair_scores")
        # softmax numerators; divided by their sum below
        check(lib.dsa_pair_exp(ptr(sc), ptr(pair_q), ptr(rowmax), n), "dsa_pair_exp")
        check(lib.dsa_pair_values(ptr(vh), vh.stride(0), tk, v.shape[-1], ptr(key_start), ptr(pair_q), ptr(sc),
                                  ptr(o[j]), o.stride(1), ptr(rowsum), nq), "dsa_pair_values")
    if o is not out:
        out.copy_(o)


def _gathered_attend(q, k, v, topk_idx, scale: float, budget_bytes: int, grad: bool, complete: bool = False):
    """Gather each query block's selected key (and value) rows for all sequences at once, then matmul +
    softmax + matmul; differentiable. [B, H, Tq, Dv] in q's dtype; rows with no slot come out finite (the
    caller zeroes them). complete: no slot is -1 (then nothing is masked). At most SMALL_ROWS (sequence, query)
    rows in all (decode) without autograd compute in fp32 even for bf16 inputs: oneDNN's set-up for a bf16 bmm
    this small costs more than converting the rows."""
    b, h, tq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g, n_top = h // hkv, topk_idx.shape[-1]
    shared = _values_in_keys(k, v)
    k_rows, k_stride = key_rows(k.transpose(1, 2))  # row b * S + n starts with k[b, :, n]
    v_rows, v_stride = (k_rows, k_stride) if shared else key_rows(v.transpose(1, 2))
    per_query = b * n_top * hkv * (dk + (0 if shared else dv)) * q.element_size() + 8 * b * h * n_top
    block = _block(per_query, tq, min(budget_bytes, GATHER_BLOCK_BYTES))
    qt = q.transpose(1, 2)  # [B, Tq, H, Dk]: the model's own layout, so usually a view
    # Without autograd one gather buffer serves every block: fresh multi-MB allocations page-fault each time.
    reuse = block < tq and not grad
    k_buf = k_rows.new_empty(b * block * n_top, k_rows.shape[1]) if reuse else None
    work = torch.float32 if b * tq <= SMALL_ROWS and not grad else q.dtype
    out = []
    for s in range(0, tq, block):
        e = min(tq, s + block)
        n = e - s
        ix = topk_idx[:, s:e].long()
        unused = None if complete else ix < 0
        ix = ix if complete else ix.clamp(min=0)
        kg = _take_rows(k_rows, ix, k_stride, hkv * dk, k_buf).to(work)  # [B*n*K, Hkv*Dk]
        vg = kg if shared else _take_rows(v_rows, ix, v_stride, hkv * dv).to(work)
        if hkv == 1:  # MQA / MLA latent: one [H, Dk] x [Dk, K] product per query, no head axis on the keys
            k3, v3 = kg.view(b * n, n_top, dk), vg.view(b * n, n_top, -1)[..., :dv]
        else:
            k3 = kg.view(b * n, n_top, hkv, dk).transpose(1, 2).reshape(b * n * hkv, n_top, dk)
            v3 = vg.view(b * n, n_top, hkv, -1)[..., :dv].transpose(1, 2).reshape(b * n * hkv, n_top, dv)
        q3 = qt[:, s:e].reshape(b * n * hkv, g, dk).to(work)
        sc = torch.bmm(q3, k3.transpose(1, 2)).float().mul_(scale)  # [B*n*Hkv, G, K]
        if unused is not None:
            mask = unused.view(b * n, 1, n_top)
            if hkv > 1:  # the rows are (sequence, query, key head)
                mask = mask.repeat_interleave(hkv, 0)
            # The most negative float, not -inf: a row with nothing selected stays finite (the caller zeroes it).
            sc = sc.masked_fill_(mask, torch.finfo(torch.float32).min)
        p = torch.softmax(sc, -1).to(work)
        out.append(torch.bmm(p, v3).view(b, n, h, dv))
    o = torch.cat(out, 1) if len(out) > 1 else out[0]
    return o.to(q.dtype).transpose(1, 2)


def _output_like(q, dv: int) -> torch.Tensor:
    """An empty [B, H, Tq, dv] output in q's memory layout: a transposed view of [B, Tq, H, dv] when q is one
    (the model's layout), so that the caller's transpose back is free."""
    b, h, tq, _ = q.shape
    if q.transpose(1, 2).is_contiguous():
        return q.new_empty(b, tq, h, dv).transpose(1, 2)
    return q.new_empty(b, h, tq, dv)


def _values_in_keys(k, v) -> bool:
    """Whether v is k's leading channels (same storage, same strides): one gather then serves both."""
    return (v.dtype == k.dtype and v.shape[:3] == k.shape[:3] and v.stride() == k.stride()
            and v.data_ptr() == k.data_ptr() and v.shape[-1] <= k.shape[-1])


def _take_rows(rows, ix, stride: int, width: int, buf=None) -> torch.Tensor:
    """rows [B*S, W] gathered at the slots ix [B, n, K] of each sequence: [B*n*K, width] (into buf's front)."""
    offsets = torch.arange(0, ix.shape[0] * stride, stride, device=ix.device)[:, None, None]
    flat = (ix + offsets).view(-1)
    if buf is None:
        return rows.index_select(0, flat)[:, :width]
    return torch.index_select(rows, 0, flat, out=buf[: flat.numel()])[:, :width]


def key_rows(k: torch.Tensor) -> tuple[torch.Tensor, int]:
    """k [B, N, ...] as a matrix of rows [B*S, W] in which row b*S + n starts with k[b, n] (its first
    k[0, 0].numel() columns), and S.

    Without copying when every k[b, n] is one contiguous run and batches are whole rows apart (a view of a
    preallocated cache: S is its capacity and W its full row, which may hold more entries after the key);
    otherwise a contiguous copy with S = N and W = the key width. Rows are gathered whole (index_select on
    contiguous rows is a memcpy per row; on strided ones it is ~10x slower)."""
    B, N = k.shape[:2]
    width = math.prod(k.shape[2:])
    if k.is_contiguous() or not (B and N):
        return k.reshape(B * N, width), N
    row = k.stride(1)
    if _inner_contiguous(k) and row >= width and k.stride(0) % row == 0:
        step = k.stride(0) // row
        end = k.storage_offset() + B * step * row
        if step >= N and end * k.element_size() <= k.untyped_storage().nbytes():
            return k.as_strided((B * step, row), (row, 1)), step
    return k.reshape(B * N, width), N


def _inner_contiguous(k: torch.Tensor) -> bool:
    """Whether each k[b, n] is one contiguous run (what k[b, n].is_contiguous() says, without the views)."""
    expected = 1
    for size, stride in zip(reversed(k.shape[2:]), reversed(k.stride()[2:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def dsa_attention(q, k, v, index_q, index_k, weights, topk: int, *, scale=None, index_scale=None,
                  key_mask=None, key_pos=None, budget_bytes: int = DEFAULT_BUDGET, query_chunk: int | None = None,
                  score_dtype=torch.float32, value_dtype=torch.float32, return_slots: bool = False):
    """Indexer top-k then attention over the selected keys, fused per query block: a block's indexer scores
    ([B, block, Hi, Tk]) exist only while it is processed, and the top-k slots only for the current chunk of
    a few blocks, so memory is O(block x N + chunk x k) (the top-k slots of the whole sequence alone would be
    Tq x k x 8 bytes: 1 GiB at 64K x 2048).
    Blocks whose queries see at most `topk` keys skip the indexer: every visible key is selected. [B,H,Tq,Dv];
    with return_slots, also the slots [B, Tq, min(topk, Tk)] (-1 = none; int32 when several chunks are
    collected) for a layer that shares this
    selection (`gather_attention`). query_chunk: queries per indexer block (default: sized from the budget).
    Works with autograd through q, k, v (the selection itself is not differentiable).
    score_dtype / value_dtype = torch.bfloat16: indexer matmul / weighted value sum in bf16 (opt-in speed;
    the defaults keep the result equal to the dense-mask formulation within fp32 rounding)."""
    check_qkv(q, k, v)
    _check_indexer(index_q, index_k, weights, score_dtype)
    if value_dtype not in SCORE_DTYPES:
        raise ValueError(f"value_dtype={value_dtype}: expected one of {SCORE_DTYPES}")
    b, h, tq, _ = q.shape
    tk, hi, di = k.shape[2], index_q.shape[2], index_q.shape[3]
    index_scale = _check_scale(di ** -0.5 if index_scale is None else index_scale)
    past = tk - tq
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if gpu.wanted(q):  # CUDA: Triton indexer + sparse MLA attention (model/gpu.py); None: they do not apply
        out = gpu.dsa_attention(q, k, v, index_q, index_k, weights, topk, scale=scale, index_scale=index_scale,
                                key_mask=key_mask, key_pos=key_pos, score_dtype=score_dtype, return_slots=return_slots)
        if out is not None:
            return out
    grad = needs_grad(q, k, v)
    index_q, weights, index_k = index_q.detach(), weights.detach(), index_k.detach()  # the selection has no gradient
    select = _Selector(index_k, key_mask, key_pos, index_scale, topk, score_dtype,
                       query_chunk or _block(4 * (hi + 2) * tk, tq, budget_bytes), hi)
    block, n_top = select.block, select.n_top
    # Attention runs on chunks of several indexer blocks: each head's keys are then reused by the whole chunk
    # while they are in cache; the chunk's selected pairs cost chunk x k x (NATIVE_)PAIR_BYTES.
    native = dsa_kernels() is not None and value_dtype == torch.float32 and not grad and q.device.type == "cpu"
    chunk = block if query_chunk else max(block, _pair_block(n_top, tq, budget_bytes, native) // block * block)
    if value_dtype != torch.float32 and not grad:
        v = v.to(value_dtype)  # one O(N) cast, not one per block
    single = chunk >= tq  # one chunk: its output (and its slots) are the result
    # The slots a shared layer reuses are kept as int32: [B, Tq, k] of them (64 MiB at 64K x 128 in int64).
    slots = None if not return_slots or single else torch.full((b, tq, n_top), -1, dtype=torch.int32, device=q.device)
    out = [] if grad or single else _output_like(q, v.shape[-1])  # autograd: chunks concatenated, no in-place writes
    for c in range(0, tq, chunk):
        ce = min(tq, c + chunk)
        qe = past + ce  # the chunk only ever sees keys up to its last query
        with torch.no_grad():
            if ce - c <= block:  # one block (a decode step): its selection is the chunk's
                idx = select(index_q[:, c:ce], weights[:, c:ce], past + c, qe)
            else:
                idx = torch.full((b, ce - c, min(n_top, qe)), -1, dtype=torch.long, device=q.device)
                for s in range(c, ce, block):
                    e = min(ce, s + block)
                    sel = select(index_q[:, s:e], weights[:, s:e], past + s, past + e)
                    idx[:, s - c:e - c, :sel.shape[-1]] = sel
        if return_slots and single:
            slots = idx if idx.shape[-1] == n_top else F.pad(idx, (0, n_top - idx.shape[-1]), value=-1)
        elif return_slots:
            slots[:, c:ce, :idx.shape[-1]] = idx
        # Every query past the first n_top slots of a sequence without padding sees n_top keys: no slot unused.
        complete = select.plain and past + c >= n_top or bool((idx >= 0).all())
        o = _attend_slots(q[:, :, c:ce], k[:, :, :qe], v[:, :, :qe], idx, scale, budget_bytes, True, grad, complete)
        if isinstance(out, list):
            out.append(o)
        else:
            out[:, :, c:ce] = o
    if isinstance(out, list):
        out = torch.cat(out, 2) if len(out) > 1 else out[0]
    return (out, slots) if return_slots else out


# ---- Pooled selection (GLM-5.3): the indexer scores groups of consecutive keys --------------------------------


def pooled_topk_slots(index_q, index_k, gate, ape, weights, topk: int, kpool: int, *, scale: float,
                      key_mask=None, query_mask=None, select_tail: bool = True,
                      budget_bytes: int = DEFAULT_BUDGET) -> torch.Tensor:
    """DSA's selection over groups of `kpool` consecutive keys, as GLM-5.3's indexer makes it: key slots
    [B, Tq, topk + (kpool - 1 if select_tail else 0)] per query (-1 = none), for `gather_attention`.

    index_q [B, Tq, Hi, Di] and weights [B, Tq, Hi] (already scaled) as for `indexer_topk`; index_k and gate
    [B, N, Di] per cache slot (the queries are the last Tq slots); ape [kpool, Di]; key_mask / query_mask [B, N] /
    [B, Tq] bool (None: no padding). Groups are aligned at each sequence's first valid key, so left padding does
    not shift them. A group's key is the mean of its keys weighted by softmax(gate + ape) over the group; a group is
    a candidate for a query when all its keys are valid and its last key is visible. Each query keeps its best
    topk / kpool candidate groups (score sum_h w_h relu(scale q_h . group key), ties broken by torch.topk over
    the same row as transformers' Glm5NextTextIndexer) and, with select_tail, the visible keys after its last
    complete group. The selection is not differentiable."""
    b, tq, hi, di = index_q.shape
    n = index_k.shape[1]
    _check_scale(scale)
    with torch.no_grad():
        first = _first_valid(key_mask, b, n, index_k.device)
        pools = _Pools(index_k, gate, ape, key_mask, first, kpool)
        qpos = torch.arange(n - tq, n, device=index_k.device)
        n_pools = pools.keys.shape[1]
        block = _block(8 * b * hi * max(n_pools, 1), tq, budget_bytes)
        width = topk + (kpool - 1 if select_tail else 0)
        out = torch.full((b, tq, width), -1, dtype=torch.long, device=index_k.device)
        visible_count = (qpos + 1 - first[:, None] if key_mask is None
                         else key_mask.long().cumsum(-1)[:, qpos])  # [B, Tq] visible valid keys
        for s in range(0, tq, block):
            e = min(tq, s + block)
            groups, slots = pools.select(index_q[:, s:e].float(), weights[:, s:e].float(), qpos[s:e], scale,
                                         topk // kpool)
            out[:, s:e, :slots.shape[-1]] = slots
            if select_tail and kpool > 1:
                out[:, s:e, topk:] = _tail_slots(first, visible_count[:, s:e], qpos[s:e], key_mask, groups, kpool, n)
        if query_mask is not None:
            out.masked_fill_(~query_mask[..., None], -1)
    return out


def _first_valid(key_mask, b: int, n: int, device) -> torch.Tensor:
    """[B] the slot of each sequence's first valid key (n when it has none)."""
    if key_mask is None:
        return torch.zeros(b, dtype=torch.long, device=device)
    return torch.where(key_mask.any(-1), key_mask.long().argmax(-1), torch.full((b,), n, device=device))


class _Pools:
    """The key groups of one forward: their pooled keys, slots and validity, over the groups valid in some
    sequence of the batch (the candidate row transformers scores, so that torch.topk breaks ties alike)."""

    def __init__(self, index_k, gate, ape, key_mask, first, kpool: int):
        b, n, _ = index_k.shape
        n_pools = -(-n // kpool)
        slots = first[:, None, None] + torch.arange(n_pools * kpool, device=index_k.device).view(1, n_pools, kpool)
        in_range = slots < n
        safe = slots.clamp(0, n - 1)
        rows = torch.arange(b, device=index_k.device)[:, None, None]
        valid = in_range if key_mask is None else in_range & key_mask[rows, safe]
        logits = (gate[rows, safe].float() + ape.float()).masked_fill(~valid[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(2))  # a group with no valid key: zeros, not NaN
        keys = (weights * index_k[rows, safe].float()).sum(2)
        pool_valid = valid.all(-1)
        keep = pool_valid.any(0)
        self.ids = keep.nonzero().squeeze(1)  # [P'] group number of each kept group
        self.keys, self.valid = keys[:, keep], pool_valid[:, keep]  # [B, P', Di], [B, P']
        self.slots = slots[:, keep]  # [B, P', kpool]
        self.end = self.slots[..., -1]  # [B, P'] each group's last slot

    def select(self, q, w, qpos, scale: float, n_groups: int):
        """(group numbers [B, Q, k] (-1 = none), their slots [B, Q, k * kpool]) of the queries at slots qpos."""
        b, nq = q.shape[:2]
        scores = torch.matmul(q, self.keys.transpose(1, 2).unsqueeze(1))  # [B, Q, Hi, P']
        scores = F.relu(scores * scale)
        summed = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [B, Q, P']
        candidate = self.valid[:, None, :] & (self.end[:, None, :] <= qpos[None, :, None])
        summed = summed.masked_fill(~candidate, torch.finfo(summed.dtype).min)
        k = min(n_groups, summed.shape[-1])
        chosen = summed.topk(k, dim=-1).indices  # [B, Q, k]
        ok = candidate.gather(-1, chosen)
        rows = torch.arange(b, device=q.device)[:, None, None]
        slots = self.slots[rows, chosen].masked_fill(~ok[..., None], -1).flatten(-2)
        return self.ids[chosen].masked_fill(~ok, -1), slots


def _tail_slots(first, visible_count, qpos, key_mask, groups, kpool: int, n: int) -> torch.Tensor:
    """[B, Q, kpool - 1]: the visible keys after each query's last complete group (-1 = none), minus any that
    lie in a selected group (possible only when the padding has holes)."""
    offsets = torch.arange(kpool - 1, device=first.device)
    tail_count = visible_count.remainder(kpool)
    start = first[:, None] + visible_count - tail_count
    slots = start[..., None] + offsets  # [B, Q, kpool - 1]
    ok = (offsets < tail_count[..., None]) & (slots < n) & (slots <= qpos[None, :, None])
    if key_mask is not None:
        rows = torch.arange(first.shape[0], device=first.device)[:, None, None]
        ok &= key_mask[rows, slots.clamp(0, n - 1)]
        group_of = (slots - first[:, None, None]).div(kpool, rounding_mode="floor")
        ok &= ~(group_of[..., None] == groups[:, :, None, :]).any(-1)
    return slots.masked_fill(~ok, -1)
