"""The routed experts as two Triton grouped GEMMs with fused epilogues.

The N x k (token, expert) assignments are sorted by expert (stable: token order inside an expert, as the
PyTorch path sorts them) and each expert's run is padded to a whole number of BLOCK_M rows, so every row block
of the sorted list belongs to one expert. Then, per row block and column block:

1. `_gate_up_kernel`: gate and up tiles of x[token] @ W_gate_up[e]^T (two fp32 accumulators over one read of
   the x tile); epilogue silu(gate) * up, written once to the intermediate [rows, I] in the model dtype.
2. `_down_kernel`: intermediate @ W_down[e]^T in fp32; epilogue: times the assignment's routing weight, then
   atomically added into the fp32 output row of its token (the scatter-add: no [N*k, H] buffer, no second
   pass). The k additions into one output element arrive in any order, so the last bit of an fp32 sum can
   differ from run to run.

Quantised weights (int8 or float8_e4m3fn values plus fp32 scales, one per block of SB_N output rows x SB_K
input columns: 128 x 128 for the GLM FP8 checkpoints, 1 x K for one scale per row) are read as stored; each
K tile is widened to the activation dtype (exact for int8 and e4m3) and its scale is applied to the tile's
fp32 product, so a K tile must lie inside one scale block (BLOCK_K divides SB_K).

The routing itself (the router, group-limited top-k) stays the model's: this module gets the chosen experts
and their weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openglm.kernels.common import check_device, dot_options

MAX_ASSIGNMENTS = 1 << 17  # assignments per launch: bounds the [rows, I] intermediate (larger batches loop)
QUANTIZED = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class ExpertWeights:
    """One expert stack as the kernels read it: values [E, out, in] (fp32, bf16, int8 or float8_e4m3fn) and,
    for int8 / fp8 values, fp32 scales [E, ceil(out / block[0]), ceil(in / block[1])]."""
    values: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    def check(self, name: str, out_features: int, in_features: int) -> None:
        v = self.values
        if v.dim() != 3 or v.shape[1:] != (out_features, in_features):
            raise ValueError(f"{name}: expected [E, {out_features}, {in_features}] weights, got {tuple(v.shape)}")
        if v.stride(-1) != 1:
            raise ValueError(f"{name}: the weights' last dimension must be contiguous")
        if (self.scale is None) != (v.dtype not in QUANTIZED):
            raise ValueError(f"{name}: {v.dtype} weights {'need' if self.scale is None else 'take no'} scales")
        if self.scale is not None:
            bn, bk = self.block
            want = (v.shape[0], -(-out_features // bn), -(-in_features // bk))
            if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != want:
                raise ValueError(f"{name}: scales {tuple(self.scale.shape)} {self.scale.dtype}, expected fp32 {want} "
                                 f"for blocks of {list(self.block)}")


def per_row(values: torch.Tensor, scale: torch.Tensor) -> ExpertWeights:
    """Quantised values [E, out, in] with one fp32 scale per output row ([E, out, 1], as `--quantization`
    stores them) as block scales of 1 x in."""
    return ExpertWeights(values, scale.reshape(values.shape[0], values.shape[1], 1).float(), (1, values.shape[2]))


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(assignments: int, n_experts: int, dtype: torch.dtype, scale_k: int | None) -> Tiles:
    """Tile sizes from the rows per expert (decode: a few; prefill: hundreds). Untuned defaults of the usual
    shapes for Hopper-class GPUs; `benchmarks/bench_gpu.py` is where a tuning would be measured."""
    per_expert = assignments / max(1, n_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_k = 32 if dtype == torch.float32 else 64
    if scale_k is not None:
        while scale_k % block_k and block_k > 16:
            block_k //= 2
    # 64 x 128 tiles of two accumulators need 8 warps to stay within 255 registers without spilling on sm_90
    # (tests/kernels/test_compile.py compiles these choices for sm_80 and sm_90)
    wide = block_m == 64
    return Tiles(block_m, 128 if wide else 64, block_k, 8 if wide else 4, 2 if dtype == torch.float32 else 3)


def fused_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
                  down: ExpertWeights, tiles: Tiles | None = None, check_indices: bool = True) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = indices[t, j], for every
    token t: [N, H] in x's dtype (fp32 accumulation throughout).

    x [N, H] (fp32 or bf16); indices [N, k] expert ids, distinct within a row (as top-k gives them); weights
    [N, k] routing weights (any float dtype); gate_up.values [E, 2I, H] (gate rows first), down.values [E, H, I].
    check_indices=False skips the range check (a device-to-host copy) for indices a router just produced."""
    if x.dim() != 2 or indices.dim() != 2 or indices.shape != weights.shape or indices.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)}, indices {tuple(indices.shape)}, weights {tuple(weights.shape)}: "
                         "expected [N, H], [N, k], [N, k]")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    n_tokens, hidden = x.shape
    n_experts, two_inter = gate_up.values.shape[:2]
    inter = two_inter // 2
    gate_up.check("gate_up", 2 * inter, hidden)
    down.check("down", hidden, inter)
    if down.values.shape[0] != n_experts:
        raise ValueError(f"gate_up has {n_experts} experts, down {down.values.shape[0]}")
    for w in (gate_up, down):
        if w.values.dtype not in QUANTIZED and w.values.dtype != x.dtype:
            raise ValueError(f"weights {w.values.dtype} with activations {x.dtype}: "
                             "expected quantised weights or the activations' dtype")
    device = check_device(x, indices, weights, gate_up.values, down.values, gate_up.scale, down.scale)
    out = torch.zeros(n_tokens, hidden, dtype=torch.float32, device=device)
    top_k = indices.shape[1]
    if n_tokens == 0 or top_k == 0:
        return out.to(x.dtype)
    if check_indices and (int(indices.min()) < 0 or int(indices.max()) >= n_experts):
        raise IndexError(f"expert indices must be in [0, {n_experts})")
    x = x if x.stride(-1) == 1 else x.contiguous()
    per_launch = max(1, MAX_ASSIGNMENTS // top_k)
    for s in range(0, n_tokens, per_launch):
        e = min(n_tokens, s + per_launch)
        _launch(x[s:e], indices[s:e], weights[s:e].float(), gate_up, down, out[s:e], inter, tiles)
    return out.to(x.dtype)


def align_by_expert(indices: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] int32, block_expert [P / block_m] int32) for the flattened assignments a = t * k + j:
    sorted_ids lists them grouped by expert (token order inside an expert), each expert's run padded with the
    out-of-range id N*k to a multiple of block_m; block_expert names each row block's expert (-1 past the
    last). P is an upper bound fixed by the shapes, so this needs no device-to-host copy."""
    flat = indices.reshape(-1).long()
    m = flat.numel()
    counts = torch.bincount(flat, minlength=n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    pos = padded_end[expert] - padded[expert] + torch.arange(m, device=flat.device) - start[expert]
    n_blocks = triton.cdiv(m, block_m) + min(n_experts, m)  # every non-empty expert wastes < one block
    sorted_ids = torch.full((n_blocks * block_m,), m, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    block_start = torch.arange(n_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _launch(x, indices, weights, gate_up: ExpertWeights, down: ExpertWeights, out, inter: int, tiles: Tiles | None):
    n_tokens, hidden = x.shape
    top_k, n_experts = indices.shape[1], gate_up.values.shape[0]
    m = n_tokens * top_k
    scale_k = [w.block[1] for w in (gate_up, down) if w.scale is not None]
    t = tiles or choose_tiles(m, n_experts, x.dtype, min(scale_k) if scale_k else None)
    for w in (gate_up, down):
        if w.scale is not None and w.block[1] % t.block_k and w.block[1] < w.values.shape[2]:
            raise ValueError(f"BLOCK_K={t.block_k} does not divide the scale block {w.block[1]}")
    sorted_ids, block_expert = align_by_expert(indices, n_experts, t.block_m)
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    if max(x.numel(), act.numel(), out.numel(), gate_up.values[0].numel(), down.values[0].numel()) >= 2 ** 31:
        raise ValueError("the experts kernels address each tensor (one expert's weights) with 32-bit offsets: "
                         f"{n_tokens} tokens x {hidden} or {inter}-wide rows are too many for one launch")
    upcast, precision = dot_options(x.dtype)
    dot_dtype = (tl.float32 if upcast or x.dtype == torch.float32
                 else tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    gu, dn = gate_up, down
    gu_s = gu.scale if gu.scale is not None else x  # a placeholder pointer: never read without scales
    dn_s = dn.scale if dn.scale is not None else x
    n_blocks = block_expert.numel()
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, t.block_n))](
        x, x.stride(0), gu.values, gu.values.stride(0), gu.values.stride(1),
        gu_s, *(_scale_strides(gu)), sorted_ids, block_expert, act, act.stride(0), m, top_k, inter, hidden,
        QUANT=gu.scale is not None, EVEN_K=hidden % t.block_k == 0, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages)
    _down_kernel[(n_blocks, triton.cdiv(hidden, t.block_n))](
        act, act.stride(0), dn.values, dn.values.stride(0), dn.values.stride(1),
        dn_s, *(_scale_strides(dn)), sorted_ids, block_expert, weights.reshape(-1).contiguous(),
        out, out.stride(0), m, top_k, hidden, inter,
        QUANT=dn.scale is not None, EVEN_K=inter % t.block_k == 0, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, DOT_DTYPE=dot_dtype, PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages)


def _scale_strides(w: ExpertWeights) -> tuple[int, int, int, int, int]:
    """(expert, row-block, column-block strides, SB_N, SB_K) of the scales; zeros without scales."""
    if w.scale is None:
        return 0, 0, 0, 1, 1
    s = w.scale
    return s.stride(0), s.stride(1), s.stride(2), w.block[0], w.block[1]


@triton.jit
def _weight_tile(ptrs, k_ok, EVEN_K: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The [BK, BN] weight tile at `ptrs` in DOT_DTYPE, zero where k_ok is false (unless EVEN_K: no partial tile).
    int8 / e4m3 values are widened in registers (exactly); their loads take no `other=` fill, which the
    interpreter cannot cast to fp8, and are zeroed after the widening instead."""
    if EVEN_K:
        w = tl.load(ptrs)
    elif QUANT:
        w = tl.load(ptrs, mask=k_ok[:, None])
    else:
        w = tl.load(ptrs, mask=k_ok[:, None], other=0)
    w = w.to(DOT_DTYPE)
    if QUANT and not EVEN_K:
        w = tl.where(k_ok[:, None], w, 0.0)
    return w


@triton.jit
def _gate_up_kernel(x_ptr, stride_x, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, stride_sk, SB_N, SB_K,
                    ids_ptr, expert_ptr, act_ptr, stride_act, M, TOP_K, INTER, HIDDEN,
                    QUANT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    e = tl.maximum(expert, 0).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rows)
    valid = ids < M  # padding rows (and every row of a block past the last expert) hold M
    token = tl.where(valid, ids // TOP_K, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = n % INTER  # wrapped: the weight loads need no column mask (the store has one)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_x + ks[None, :]
    g_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None]  # gate rows; up rows are INTER below
    u_ptrs = g_ptrs + INTER * stride_wn
    sg_ptrs = s_ptr + e * stride_se + (cols // SB_N) * stride_sn
    su_ptrs = s_ptr + e * stride_se + ((cols + INTER) // SB_N) * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert >= 0, HIDDEN, 0)  # a block past the last expert computes nothing
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = ks < HIDDEN - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0)
        a = a.to(DOT_DTYPE)
        gate = tl.dot(a, _weight_tile(g_ptrs, k_ok, EVEN_K, QUANT, DOT_DTYPE), input_precision=PRECISION)
        up = tl.dot(a, _weight_tile(u_ptrs, k_ok, EVEN_K, QUANT, DOT_DTYPE), input_precision=PRECISION)
        if QUANT:  # the K tile lies in one scale block: one scale per output column
            gate = gate * tl.load(sg_ptrs + (k0 // SB_K) * stride_sk)[None, :]
            up = up * tl.load(su_ptrs + (k0 // SB_K) * stride_sk)[None, :]
        acc_gate += gate
        acc_up += up
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) * up, in fp32
    out = act_ptr + rows[:, None] * stride_act + n[None, :]
    tl.store(out, h.to(act_ptr.dtype.element_ty), mask=valid[:, None] & (n < INTER)[None, :])


@triton.jit
def _down_kernel(act_ptr, stride_act, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, stride_sk, SB_N, SB_K,
                 ids_ptr, expert_ptr, route_ptr, out_ptr, stride_out, M, TOP_K, HIDDEN, INTER,
                 QUANT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    e = tl.maximum(expert, 0).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rows)
    valid = ids < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = n % HIDDEN
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_act + ks[None, :]
    w_ptrs = w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None]
    s_ptrs = s_ptr + e * stride_se + (cols // SB_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert >= 0, INTER, 0)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = ks < INTER - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0)
        part = tl.dot(a.to(DOT_DTYPE), _weight_tile(w_ptrs, k_ok, EVEN_K, QUANT, DOT_DTYPE), input_precision=PRECISION)
        if QUANT:
            part = part * tl.load(s_ptrs + (k0 // SB_K) * stride_sk)[None, :]
        acc += part
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    route = tl.load(route_ptr + ids, mask=valid, other=0.0)
    token = tl.where(valid, ids // TOP_K, 0)
    tl.atomic_add(out_ptr + token[:, None] * stride_out + n[None, :], acc * route[:, None],
                  mask=valid[:, None] & (n < HIDDEN)[None, :], sem="relaxed")  # plain sums: no ordering needed
