"""The model's GPU fast paths: where the MoE layer and the DSA path hand CUDA tensors to the Triton kernels of
`openglm.kernels` (imported only here, and only once a CUDA tensor arrives: the CPU path never loads triton).

Dispatch points (each a few lines, marked "CUDA: Triton"): `moe.Experts.forward`, `glm5.sparse_dsa.dsa_attention`
and `glm5.sparse_dsa.gather_attention`. Each calls a function here, which returns None where the kernels do not
apply (the caller then runs its PyTorch ops):
- experts: silu experts, fp32 / bf16 activations, weights of that dtype or int8 / fp8 `QuantizedWeight`s, no
  capacity limit. With autograd, the kernels compute the forward and the backward recomputes the experts
  through the PyTorch grouped path and backpropagates through it (the experts' activations are not kept, as
  under activation checkpointing; the price is one extra PyTorch forward of the experts).
- DSA: the Triton indexer selects (no gradient, as the selection never has one); the Triton sparse MLA kernel
  attends when the keys are one latent head whose leading channels are the values (MLA's absorbed form) and
  no gradient is needed; otherwise (training) the PyTorch gather path attends over the Triton selection.

`OPENGLM_GPU_KERNELS=0`, or the `pytorch_ops()` context, keeps CUDA tensors on the PyTorch ops (the
benchmark's and the parity tests' baseline). Without triton installed, CUDA runs the PyTorch ops and warns once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings

import torch
import torch.nn.functional as F

from openglm.model.quantized import QuantizedWeight

_OFF = contextvars.ContextVar("openglm_gpu_kernels_off", default=False)


@contextlib.contextmanager
def pytorch_ops():
    """Inside the block, CUDA tensors take the model's PyTorch ops instead of the Triton kernels."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def wanted(t: torch.Tensor) -> bool:
    """Whether `t`'s op should run a Triton kernel: a CUDA tensor, kernels not switched off, triton present."""
    return (kernel_device(t) and not _OFF.get() and os.environ.get("OPENGLM_GPU_KERNELS", "1") != "0"
            and _triton_present())


def kernel_device(t: torch.Tensor) -> bool:
    """Whether `t` lives where the compiled kernels run (the tests point this at the CPU, whose tensors the
    kernels then run in Triton's interpreter)."""
    return t.is_cuda


@functools.lru_cache(maxsize=1)
def _triton_present() -> bool:
    try:
        import triton  # optional (the `gpu` extra): only probed once a CUDA tensor arrives
    except ImportError:
        warnings.warn("triton is not installed: CUDA runs the PyTorch ops (pip install 'openglm[gpu]' for the "
                      "Triton kernels)", stacklevel=3)
        return False
    return bool(triton.__version__)


# ---- MoE experts ---------------------------------------------------------------------------------------

def experts_forward(experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """`Experts.forward`'s output (no capacity) through the Triton experts, or None where they do not apply."""
    from openglm.kernels import moe as kernels  # imports triton: only for CUDA tensors (or the interpreter)

    if experts.act is not F.silu or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    gate_up = _expert_weights(kernels, experts.gate_up_proj, x.dtype)
    down = _expert_weights(kernels, experts.down_proj, x.dtype)
    if gate_up is None or down is None:
        return None
    params = (experts.gate_up_proj, experts.down_proj)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, *params)):
        return _RecomputedExperts.apply(x, weights, *params, indices, experts, gate_up, down)
    return kernels.fused_experts(x, indices, weights, gate_up, down, check_indices=False)  # the router's picks


def _expert_weights(kernels, w: torch.Tensor, dtype: torch.dtype):
    if isinstance(w, QuantizedWeight):
        if w.qdata.dtype not in kernels.QUANTIZED or w.qdata.dim() != 3:
            return None
        if w.qdata.dtype == torch.float8_e4m3fn and w.is_cuda and torch.cuda.get_device_capability(w.device) < (8, 9):
            return None  # e4m3 conversions need sm_89+ (Ada, Hopper and later)
        return kernels.per_row(w.qdata, w.scale)
    if w.dtype != dtype or w.dim() != 3 or w.stride(-1) != 1:
        return None
    return kernels.ExpertWeights(w.detach())


class _RecomputedExperts(torch.autograd.Function):
    """Triton forward; the backward re-runs the PyTorch experts on the saved inputs and backpropagates."""

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, indices, experts, gate_up_w, down_w):
        from openglm.kernels import moe as kernels  # as in experts_forward: triton only on this path

        ctx.save_for_backward(x, weights, indices)
        ctx.experts = experts
        return kernels.fused_experts(x, indices, weights, gate_up_w, down_w, check_indices=False)

    @staticmethod
    def backward(ctx, grad):
        x, weights, indices = ctx.saved_tensors
        experts = ctx.experts
        params = [experts.gate_up_proj, experts.down_proj]
        with torch.enable_grad(), pytorch_ops():
            x_ = x.detach().requires_grad_(ctx.needs_input_grad[0])
            w_ = weights.detach().requires_grad_(ctx.needs_input_grad[1])
            out, _ = experts.forward(x_, indices, w_)  # not __call__: the module's hooks ran in the forward
            wanted = [(t, need) for t, need in zip([x_, w_, *params], ctx.needs_input_grad[:4]) if need]
            grads = iter(torch.autograd.grad(out, [t for t, _ in wanted], grad.to(out.dtype), allow_unused=True))
        result = [next(grads) if need else None for need in ctx.needs_input_grad[:4]]
        return (*result, None, None, None, None)


# ---- DSA -------------------------------------------------------------------------------------------------

def dsa_attention(q, k, v, index_q, index_k, weights, topk: int, *, scale: float, index_scale: float,
                  key_mask=None, key_pos=None, score_dtype=torch.float32, return_slots: bool = False):
    """`sparse_dsa.dsa_attention` through the Triton indexer and attention, or None where they do not apply
    (explicit key positions: the model never passes them)."""
    from openglm.kernels import dsa as kernels  # imports triton: only for CUDA tensors (or the interpreter)

    if key_pos is not None:
        return None
    slots = kernels.indexer_topk(index_q.detach(), weights.detach().float() * index_scale, index_k.detach(), topk,
                                 key_valid=key_mask, score_dtype=score_dtype)
    out = _attend(kernels, q, k, v, slots, scale)
    return (out, slots) if return_slots else out


def gather_attention(q, k, v, slots, scale: float):
    """`sparse_dsa.gather_attention` (attention over given slots) through the Triton kernel, or None."""
    from openglm.kernels import dsa as kernels  # imports triton: only for CUDA tensors (or the interpreter)

    return _attend(kernels, q, k, v, slots, scale)


def _attend(kernels, q, k, v, slots, scale: float):
    """q [B, H, Tq, D] over k [B, 1, Tk, D] whose leading v.shape[-1] channels are v: [B, H, Tq, rank] from the
    Triton kernel; any other case (several key heads, separate values, autograd) through the PyTorch gather."""
    from openglm.model.glm5 import sparse_dsa  # sparse_dsa dispatches here: a module-level import would be a cycle

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if grad or k.shape[1] != 1 or not _values_in_keys(k, v) or q.dtype not in (torch.float32, torch.bfloat16):
        with pytorch_ops():
            return sparse_dsa.gather_attention(q, k, v, slots, scale=scale)
    rank = v.shape[-1]
    keys = k[:, 0]  # [B, Tk, D]: rows of the cache (a view)
    out = kernels.sparse_mla_attention(q.transpose(1, 2), keys[..., :rank], keys[..., rank:], slots, scale)
    return out.transpose(1, 2)


def _values_in_keys(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is a view of k's leading channels (MLA's latent is both key and value)."""
    return (v.dtype == k.dtype and v.shape[:3] == k.shape[:3] and v.stride()[:3] == k.stride()[:3]
            and v.data_ptr() == k.data_ptr() and v.shape[-1] <= k.shape[-1] and v.stride(-1) == 1)
