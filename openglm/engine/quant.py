"""Weight-only quantisation: int8 or fp8 (e4m3) weights with per-channel scales.

Each quantised weight is stored as a low-precision tensor plus one float scale per output row
(the last dimension is the one reduced, so a `[out, in]` Linear weight and a `[E, out, in]`
expert stack both get one scale per output channel). Weights are dequantised into the compute
dtype when their decoder layer runs and dropped when it returns (hooks on the layer, not on the
Linear: MLA reads `kv_b_proj.weight` directly to absorb it into the query), so at most one layer's
weights are held at full precision. Norms, embeddings and the small DSA `weights_proj` (kept in fp32
by GLM) stay unquantised.
"""

from __future__ import annotations

import re

import torch
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SKIP_NAMES = ("norm", "embed", "weights_proj")
LAYER = re.compile(r"^(.*\blayers\.\d+)(\.|$)")


def quantize_tensor(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    if kind == "int8":
        scale = amax / 127.0
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    elif kind == "fp8":
        scale = amax / FP8_MAX
        q = (w / scale).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown quantization {kind!r}: use int8 or fp8")
    return q, scale


def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _materialize(owner, args):
    for module, name in owner._quant_params:
        q, scale = getattr(module, f"{name}_q"), getattr(module, f"{name}_scale")
        setattr(module, name, dequantize_tensor(q, scale, module._quant_dtype))


def _release(owner, args, output):
    for module, name in owner._quant_params:
        setattr(module, name, None)
    return output


def _int8_linear(module: nn.Linear):
    """The module's forward for int8 weights: bf16 inputs through ATen's weight-only int8 matmul, which reads
    the int8 weight directly (LM head 8192 x 256, one row: ~0.2 ms, against ~20 ms to dequantise it per step);
    other dtypes dequantise for the call."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        q, scale = module.weight_q, module.weight_scale
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled():
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return torch._weight_int8pack_mm(rows, q, scale.view(-1).to(x.dtype)).view(*x.shape[:-1], q.shape[0])
        return torch.nn.functional.linear(x, dequantize_tensor(q, scale, x.dtype))
    return forward


def quantize_model(model: nn.Module, kind: str) -> dict:
    """Quantise the model's matmul weights in place; returns bytes before/after for those weights."""
    if kind not in ("int8", "fp8"):
        raise ValueError(f"unknown quantization {kind!r}: use int8 or fp8")
    modules = dict(model.named_modules())
    # a weight tied to a skipped one (lm_head tied to the embedding) stays shared and unquantised
    skipped = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if any(s in n for s in SKIP_NAMES)}
    owners: dict[str, list] = {}
    before = after = 0
    for mod_name, module in modules.items():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{name}"
            if p.dim() < 2 or not p.is_floating_point() or id(p) in skipped or any(s in full for s in SKIP_NAMES):
                continue
            q, scale = quantize_tensor(p, kind)
            before += p.numel() * p.element_size()
            after += q.numel() * q.element_size() + scale.numel() * scale.element_size()
            module._quant_dtype = p.dtype
            delattr(module, name)  # drops the Parameter
            module.register_buffer(f"{name}_q", q, persistent=False)
            module.register_buffer(f"{name}_scale", scale, persistent=False)
            setattr(module, name, None)
            m = LAYER.match(mod_name)
            owners.setdefault(m.group(1) if m else mod_name, []).append((module, name))
    for owner_name, params in owners.items():
        owner = modules[owner_name]
        if kind == "int8" and isinstance(owner, nn.Linear) and owner.bias is None and params == [(owner, "weight")]:
            owner.forward = _int8_linear(owner)  # a Linear of its own (the LM head): no per-call dequantised copy
            continue
        owner._quant_params = params
        owner.register_forward_pre_hook(_materialize)
        owner.register_forward_hook(_release)
    model._quantization = kind
    return {"kind": kind, "weight_bytes_before": before, "weight_bytes_after": after}


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (quantised weights and their scales included)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
