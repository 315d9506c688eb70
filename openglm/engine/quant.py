"""Weight-only quantisation: int8 or fp8 (e4m3) weights with per-channel scales.

Each quantised weight is stored as a low-precision tensor plus one float scale per output row
(the last dimension is the one reduced, so a `[out, in]` Linear weight and a `[E, out, in]`
expert stack both get one scale per output channel), held as a `model.quantized.QuantizedWeight`
buffer under the parameter's name: the model code runs unchanged. A decode step's products read
int8 values in place (`model/native.py`); other ops (a prefill matmul, fp8 anywhere) see the weight
dequantised for that op only, so no full-precision copy of the model is held. Norms, embeddings and
the small DSA `weights_proj` (kept in fp32 by GLM) stay unquantised.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model.quantized import QuantizedWeight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SKIP_NAMES = ("norm", "embed", "weights_proj")


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


def quantize_model(model: nn.Module, kind: str) -> dict:
    """Quantise the model's matmul weights in place; returns bytes before/after for those weights."""
    if kind not in ("int8", "fp8"):
        raise ValueError(f"unknown quantization {kind!r}: use int8 or fp8")
    # a weight tied to a skipped one (lm_head tied to the embedding) stays shared and unquantised
    skipped = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if any(s in n for s in SKIP_NAMES)}
    before = after = 0
    for mod_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{name}"
            if p.dim() < 2 or not p.is_floating_point() or id(p) in skipped or any(s in full for s in SKIP_NAMES):
                continue
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
