"""Weight-only quantisation: int8 or fp8 (e4m3) weights with per-channel scales, or int4 with group scales.

int8 / fp8: each quantised weight is stored as a low-precision tensor plus one float scale per output row
(the last dimension is the one reduced, so a `[out, in]` Linear weight and a `[E, out, in]`
expert stack both get one scale per output channel). int4: codes packed two a byte plus one bf16 scale per
group of `group` input columns (`model.quantized.quantize_int4`: GGML's Q4_0 rule, group 32 by default). Each is
held as a `model.quantized.QuantizedWeight` buffer under the parameter's name: the model code runs unchanged.
A decode step's products read int8 and int4 values in place (`model/native.py`), and so do a prefill's bf16
products (ATen's weight-only int8 matmul; `int4_kernels.h`); other ops (fp8 anywhere, an fp32 model's int4
prefill) see the weight dequantised for that op only, so no full-precision copy of the model is held. Norms,
embeddings and the small DSA `weights_proj` (kept in fp32 by GLM) stay unquantised; int4 keeps what an int4
checkpoint keeps (`model.int4.DEFAULT_NOT_CONVERT`: also the MoE routers, whose few rows decide which experts run,
as llama.cpp keeps them) and any weight whose width the group does not divide.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model import int4
from openglm.model.quantized import INT4_GROUPS, QuantizedWeight, quantize_int4

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SKIP_NAMES = ("norm", "embed", "weights_proj")
KINDS = ("int8", "fp8", "int4")


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


def quantize_model(model: nn.Module, kind: str, group: int = int4.DEFAULT_GROUP) -> dict:
    """Quantise the model's matmul weights in place (`group`: int4's group size, one of 32, 64, 128); returns
    bytes before/after for those weights."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}: use {', '.join(KINDS)}")
    if kind == "int4" and group not in INT4_GROUPS:
        raise ValueError(f"int4 group size {group!r}: use one of {', '.join(map(str, INT4_GROUPS))}")
    # a weight tied to a skipped one (lm_head tied to the embedding) stays shared and unquantised
    skipped = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if any(s in n for s in SKIP_NAMES)}
    before = after = 0
    for mod_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{name}"
            if p.dim() < 2 or not p.is_floating_point() or id(p) in skipped or any(s in full for s in SKIP_NAMES):
                continue
            if kind == "int4":
                if int4.keeps(full, int4.DEFAULT_NOT_CONVERT) or p.shape[-1] % group:
                    continue
                weight = QuantizedWeight(*quantize_int4(p, group), dtype=p.dtype)
            else:
                weight = QuantizedWeight(*quantize_tensor(p, kind), dtype=p.dtype)
            before += p.numel() * p.element_size()
            after += weight.nbytes_stored()
            delattr(module, name)  # drops the Parameter; the model reads the buffer under the same name
            module.register_buffer(name, weight, persistent=False)
    model._quantization = kind
    return {"kind": kind, "weight_bytes_before": before, "weight_bytes_after": after}


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes held by parameters and buffers (quantised weights: their values and scales)."""
    return sum(t.nbytes_stored() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers()))
