"""The one place a forward picks its paths: the reference path, or the inference fast paths.

The model's modules compute each layer once, as written, and hand every step that has a faster inference form to
an `Ops` object: a Linear, several Linears that read the same input, a norm, a per-head product, an MLP, the
routed experts, the LM head. `choose` decides once per forward call which object that is:
- `REFERENCE` (autograd records, or autocast changes dtypes per op): module calls and out-of-place ops, what
  training differentiates and what every fast path must equal;
- `INFERENCE` (no autograd): the same maths through derived weights (projections that read the same input as one
  matmul over their stacked weights, a transposed or fp32 copy, cached outside the state_dict: `derived.py`),
  in-place ops, and for a decode step's few rows the native kernels (`native.py`: `decode_kernels.c`);
- an `Inference` holding a decode plan: a decode step whose family runs whole layers natively (`glm5/decode_step.py`)
  and that asks no statistics.
A device-specific path (GPU kernels) is another `Inference` subclass, chosen here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model import isa, native
from openglm.model.derived import derived_weight, fused_rows
from openglm.model.quantized import QuantizedWeight

FEW_ROWS = 4  # experts with at most this many rows (decode) take the small-matmul paths
SMALL_BMM_ROWS = 64  # per-head products of at most this many rows run in fp32 (oneDNN's bf16 set-up costs more)
LM_HEAD_BF16_ROWS = 2  # beyond 2 bf16 rows oneDNN's matmul beats the native LM head (figures in docs/model.md)
LM_HEAD_FP32_ROWS = 64  # up to 64 fp32 rows MKL streams the head weight ~1.7x faster as W @ x^T


def choose(x: torch.Tensor, stats: bool = False, decode_plan: Callable[[], object] | None = None) -> "Reference":
    """The paths of one forward call over x (its input ids or hidden states): `REFERENCE` while autograd records or
    autocast is on, else `INFERENCE`, or an `Inference` with the plan `decode_plan()` builds (None: it has none)
    when the call asks no statistics (`stats`: the MoE statistics need the torch path's routing)."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return REFERENCE
    plan = decode_plan() if decode_plan is not None and not stats else None
    return INFERENCE if plan is None else Inference(plan)


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, i] times w [H, i, o] per head -> [B, T, H, o] in x's dtype, as one bmm over heads with
    B*T rows each (a broadcast matmul would copy w per sequence), computed in w's dtype."""
    B, T, H, i = x.shape
    out = torch.bmm(x.reshape(B * T, H, i).transpose(0, 1).to(w.dtype), w)  # [H, B*T, o]
    return out.transpose(0, 1).view(B, T, H, w.shape[-1]).to(x.dtype)


class Reference:
    """The reference path: each step as its module computes it (module calls keep every hook), out of place."""

    plan = None  # no native decode plan

    def linear(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    def linear_weight(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x times a weight that is no module's (the engine's int8 draft head), transposed."""
        return F.linear(x, w)

    def linears(self, owner: nn.Module, name: str, lins: list[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of Linears that all read x (`name`: their stacked weight's name on `owner`)."""
        return [lin(x) for lin in lins]

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def per_head(self, owner: nn.Module, name: str, x: torch.Tensor, source: torch.Tensor,
                 view: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [B, T, H, i] times w = view(source) [H, o, i] (a view of the parameter `source`), transposed, per head:
        [B, T, H, o]. `name`: the cache name of w's derived copies on `owner`."""
        return per_head_matmul(x, view(source).transpose(1, 2))

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A SwiGLU MLP (`moe.MLP`): down(act(gate(x)) * up(x))."""
        return mlp.down_proj(swiglu(mlp, mlp.gate_proj(x), mlp.up_proj(x)))

    def experts(self, experts: nn.Module, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One SwiGLU per routed expert (`moe.Experts`) over its slice of the expert-sorted rows xs (counts[e] rows
        for expert e, in order)."""
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start:start + n], experts.gate_up_proj[e]).chunk(2, dim=-1)
                ys[start:start + n] = F.linear(swiglu(experts, gate, up), experts.down_proj[e])
                start += n
        return ys

    def weighted(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows times weights (broadcast)."""
        return rows * weights

    def lm_head(self, head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return head(x)


class Inference(Reference):
    """The inference fast paths: derived weights, in-place ops, native kernels for a decode step's few rows."""

    def __init__(self, plan=None):
        self.plan = plan  # a decode plan that runs whole layers natively, or None

    def linear(self, lin, x):
        # Without the module call, so a decode step's rows take the native kernel.
        return native.linear(x, lin.weight) if lin.bias is None else lin(x)

    def linear_weight(self, x, w):
        return native.linear(x, w)

    def linears(self, owner, name, lins, x):
        if len(lins) == 1:
            return [self.linear(lins[0], x)]
        w = fused_rows(owner, name, lins)
        if w is None:
            return super().linears(owner, name, lins, x)
        return list(native.linear(x, w).split([lin.out_features for lin in lins], dim=-1))

    def norm(self, norm, x):
        # bf16: one C call for the ~30 ATen ops of the bf16 norm (a decode step runs 13 norms of a few rows, where
        # those ops' dispatch is the whole cost); the same two bf16 roundings.
        out = native.rms_norm_bf16(x, norm.weight, norm.eps) if x.dtype == torch.bfloat16 else None
        return norm(x) if out is None else out

    def per_head(self, owner, name, x, source, view):
        B, T, H, i = x.shape
        rows = B * T
        w = view(source)
        if 0 < rows <= native.max_rows():  # a decode step: decode_kernels.c streams the weight once for all rows
            laid_out = w.stride(-1) == 1 and w.stride(-2) == i
            kernel = w if laid_out else derived_weight(owner, name, [source], lambda s: view(s).contiguous())
            out = native.heads_linear(x.reshape(rows, H, i), kernel) if kernel is not None else None
            if out is not None:
                return out.view(B, T, H, -1)
        if source.dtype in (torch.bfloat16, torch.float16) and rows <= SMALL_BMM_ROWS:
            # A reduced-precision bmm this small costs ~2x more in oneDNN set-up than the fp32 product, which
            # accumulates in fp32 too (same result up to summation order): an fp32 copy of the weight.
            fp32 = derived_weight(owner, f"{name}_fp32", [source], lambda s: view(s).float())
            w = w if fp32 is None else fp32
        return per_head_matmul(x, w.transpose(1, 2))

    def mlp(self, mlp, x):
        w = fused_rows(mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])  # gate and up read the same x: one matmul
        if w is None:
            return super().mlp(mlp, x)
        rows = x.reshape(-1, x.shape[-1])
        if (mlp.act is F.silu and mlp.limit is None and rows.shape[0] <= native.max_rows()
                and native.swiglu_ok(x, w, mlp.down_proj.weight)):
            return native.swiglu(rows, [rows.shape[0]], w, mlp.down_proj.weight).view(x.shape)
        gate, up = native.linear(x, w).chunk(2, dim=-1)  # quantised weights read in place
        return self.linear(mlp.down_proj, swiglu(mlp, gate, up, inplace=True))

    def experts(self, experts, xs, counts):
        """Fewer ops per expert (in-place activation, results written straight into the output), which is what a
        decode step with ~1 token per expert is bound by; a decode step's experts in one native call."""
        if (experts.act is F.silu and experts.limit is None and 0 < max(counts) <= native.max_rows()
                and native.swiglu_ok(xs, experts.gate_up_proj, experts.down_proj)):
            return native.swiglu(xs, counts, experts.gate_up_proj, experts.down_proj)
        if int4_experts_ok(experts, xs):
            return int4_experts(experts, xs, counts)
        if 0 < max(counts) <= FEW_ROWS and grouped_mm_ok(experts, xs.dtype):
            if xs.dtype == torch.float32:
                return grouped_mm(experts, xs, counts)
            with without_onednn():  # see below: ATen's gemm is the faster one for a few bf16 rows
                return grouped_mm(experts, xs, counts)
        prefill_bf16 = xs.dtype == torch.bfloat16 and min((n for n in counts if n), default=0) > FEW_ROWS
        if prefill_bf16 and isa.experts_path() == "onednn":  # AMX: oneDNN's packed tiles (model/isa.py)
            out = onednn_experts(experts, xs, counts)
            if out is not None:
                return out
        if prefill_bf16 and grouped_mm_ok(experts, xs.dtype):
            return grouped_mm(experts, xs, counts)  # prefill: ~1.1x the per-expert loop in bf16 (fp32: slower)
        ys = torch.empty_like(xs)
        active = [(e, x, y) for e, (x, y) in enumerate(zip(xs.split(counts), ys.split(counts))) if len(x)]
        few = [a for a in active if len(a[1]) <= FEW_ROWS]
        many = [a for a in active if len(a[1]) > FEW_ROWS]
        if few and xs.dtype in (torch.bfloat16, torch.float16):
            # oneDNN spends ~40us setting up each reduced-precision matmul of a handful of rows; ATen's
            # own gemm does one in ~10us (larger row counts are faster through oneDNN again).
            with without_onednn():
                swiglu_rows(experts, few)
        else:
            many = few + many
        swiglu_rows(experts, many)
        return ys

    def weighted(self, rows, weights):
        return rows.mul_(weights)  # in place: a fresh bf16 product cost ~7x more

    def lm_head(self, head, x):
        rows = x.reshape(-1, x.shape[-1])
        w = head.weight
        if head.bias is not None:
            return head(x)
        # A decode step's rows through decode_kernels.c (streams the cold weight).
        few = native.max_rows() if x.dtype == torch.float32 else LM_HEAD_BF16_ROWS
        if x.dtype == w.dtype and (rows.shape[0] <= few or _int4(w)):
            return native.linear(x, w)
        if x.dtype == w.dtype == torch.float32 and rows.shape[0] <= LM_HEAD_FP32_ROWS:
            # With a handful of rows MKL's sgemm streams the big [vocab, hidden] weight ~1.7x faster as the left
            # operand than as the transposed right one (bf16 runs through oneDNN, where the plain form is faster).
            return (w @ rows.t()).t().contiguous().view(*x.shape[:-1], w.shape[0])
        return head(x)


REFERENCE = Reference()
INFERENCE = Inference()


def grouped_mm_ok(experts: nn.Module, dtype: torch.dtype) -> bool:
    # torch._grouped_mm (private, CPU support since torch 2.8) needs 16-byte-aligned row strides.
    E, H, inter = experts.down_proj.shape
    size = torch.finfo(dtype).bits // 8
    return (hasattr(torch, "_grouped_mm") and dtype in (torch.float32, torch.bfloat16)
            and experts.down_proj.device.type == "cpu"  # measured on the CPU; CUDA's takes bf16 on sm90+ only
            and (H * size) % 16 == 0 and (inter * size) % 16 == 0)


def grouped_mm(experts: nn.Module, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The per-expert matmuls as two grouped matmuls (one call each instead of two per active expert; measured
    1.2-1.5x faster for ~1 row per expert, fp32 and bf16). Group e's rows are xs[offsets[e-1]:offsets[e]], and the
    [E, in, out] weights are transposed views (no copy)."""
    offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=xs.device)
    gate, up = torch._grouped_mm(xs, experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return torch._grouped_mm(swiglu(experts, gate, up, inplace=True), experts.down_proj.transpose(1, 2), offs=offsets)


def swiglu(m: nn.Module, gate: torch.Tensor, up: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """act(gate) * up of an MLP or experts module `m`; with `m.limit` (glm5_next's swiglu_limit) gate is clamped from
    above and up on both sides first. inplace: gate and up are fresh matmul outputs the result may overwrite."""
    if m.limit is not None:
        gate = gate.clamp_(max=m.limit) if inplace else gate.clamp(max=m.limit)
        up = up.clamp_(-m.limit, m.limit) if inplace else up.clamp(-m.limit, m.limit)
    return m.act(gate).mul_(up) if inplace else m.act(gate) * up


def _int4(w: torch.Tensor) -> bool:
    return isinstance(w, QuantizedWeight) and w.is_int4


def int4_experts_ok(experts: nn.Module, xs: torch.Tensor) -> bool:
    """Whether `int4_experts` runs these experts: bf16 rows, int4 weights of one group, a SwiGLU, the kernels."""
    gu, dn = experts.gate_up_proj, experts.down_proj
    return (xs.dtype == torch.bfloat16 and xs.device.type == "cpu" and experts.act is F.silu and _int4(gu)
            and _int4(dn) and gu.group == dn.group and native.decode_kernels() is not None)


def int4_experts(experts: nn.Module, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each active expert's SwiGLU over its rows with int4 weights read in place (`native.int4_matmul`: dequantised
    block by block to the torch path's bf16 values), the gate / up / activation rounded to bf16 as that path rounds
    them; the down product written straight into the output."""
    gu, dn = native.kernel_weight(experts.gate_up_proj), native.kernel_weight(experts.down_proj)
    inter = experts.down_proj.shape[-1]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            x = xs[start:start + n]
            gate, up = native.int4_matmul(x, native.KernelWeight(gu.values[e], gu.scale[e], gu.wtype, gu.group),
                                          2 * inter).chunk(2, dim=-1)
            native.int4_matmul(swiglu(experts, gate, up, inplace=True),
                               native.KernelWeight(dn.values[e], dn.scale[e], dn.wtype, dn.group),
                               xs.shape[-1], ys[start:start + n])
            start += n
    return ys


def onednn_experts_ok(experts: nn.Module, xs: torch.Tensor) -> bool:
    return (xs.dtype == torch.bfloat16 and xs.device.type == "cpu" and experts.act is F.silu and experts.limit is None
            and torch.backends.mkldnn.is_available()
            and all(type(w) is nn.Parameter and w.dtype == torch.bfloat16 and w.is_contiguous()
                    for w in (experts.gate_up_proj, experts.down_proj)))


def _pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each expert's gate, up and down weights in oneDNN's blocked layout (a copy: the decode kernels keep reading
    the plain one)."""
    inter = down.shape[-1]
    pack = torch.ops.mkldnn._reorder_linear_weight
    return [(pack(gu[:inter].contiguous(), 64), pack(gu[inter:].contiguous(), 64), pack(dn, 64))
            for gu, dn in zip(gate_up.detach(), down.detach())]


def onednn_experts(experts: nn.Module, xs: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
    """Each active expert's SwiGLU through oneDNN's matmul on weights packed once (`_pack_experts`, cached with the
    weights: on AMX CPUs oneDNN runs them on the tiles): silu(x Wg) from one matmul with the SiLU fused, times x Wu
    from a second with the product fused, then Wd; fp32 accumulation, each matmul's output rounded to bf16 once.
    None when it does not apply (the caller takes the grouped path)."""
    if not onednn_experts_ok(experts, xs):
        return None
    packed = derived_weight(experts, "onednn_experts", [experts.gate_up_proj, experts.down_proj], _pack_experts)
    if packed is None:
        return None
    linear = torch.ops.mkldnn._linear_pointwise
    ys = torch.empty_like(xs)
    start = 0
    for (gate, up, down), n in zip(packed, counts):
        if n:
            x = xs[start:start + n]
            act = linear.binary(x, linear(x, gate, None, "swish", [], ""), up, None, "mul")
            ys[start:start + n] = linear(act, down, None, "none", [], "")
            start += n
    return ys


def swiglu_rows(experts: nn.Module, groups) -> None:
    """Expert e's SwiGLU of x into y, for each (e, x, y) of groups."""
    for e, x, y in groups:
        gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        torch.mm(swiglu(experts, gate, up, inplace=True), experts.down_proj[e].t(), out=y)


@contextmanager
def without_onednn():
    """Route matmuls to ATen's gemm for the block. (torch.backends.mkldnn.flags does the same but also
    re-sets the TF32 flag, which warns on every CPU-only build.) The switch is process-wide: a matmul
    on another thread meanwhile takes the ATen path too, which changes its speed, not its result."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)
