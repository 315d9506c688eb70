"""FP8 block-quantised checkpoints, in the format of zai-org's / DeepSeek's `-FP8` releases.

config.json carries
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
and each quantised weight W [out, in] is stored as `NAME.weight` (float8_e4m3fn) plus
`NAME.weight_scale_inv` (float32, [ceil(out/128), ceil(in/128)]): W = fp8 * scale_inv of its block.
Embeddings, the LM head, norms, routers, biases and the modules listed in `modules_to_not_convert` stay in
the checkpoint dtype.

openglm dequantises on load (to the requested dtype): on CPU there is no FP8 matmul, and keeping e4m3 weights
with per-tile dequantisation costs a dequantisation per matmul for half the weight memory (measured in
benchmarks/bench_fp8.py; see docs/model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openglm.model.errors import QuantizationError

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
# Modules never quantised on write (matched as substrings of the module name, as the engines do).
DEFAULT_NOT_CONVERT = ["lm_head", "model.embed_tokens", "mlp.gate", "indexer.weights_proj", "eh_proj"]


@dataclass
class Fp8Config:
    block: tuple[int, int] = (128, 128)
    modules_to_not_convert: list[str] = field(default_factory=lambda: list(DEFAULT_NOT_CONVERT))

    def to_hf(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": list(self.modules_to_not_convert)}

    def converts(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor is written quantised: a 2-D floating `.weight` outside modules_to_not_convert."""
        module = hf_name.removesuffix(".weight")
        return (hf_name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()
                and not any(m in module for m in self.modules_to_not_convert))


def parse_quantization_config(qc) -> Fp8Config | None:
    """The Fp8Config of a config.json's quantization_config (None when absent); QuantizationError names the
    key of anything else."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"quantization_config must be an object, got {type(qc).__name__}")
    checks = (("quant_method", ("fp8",)), ("fmt", ("e4m3", None)), ("activation_scheme", ("dynamic", None)))
    for key, allowed in checks:
        if qc.get(key) not in allowed:
            raise QuantizationError(f"quantization_config.{key}={qc.get(key)!r} is not supported "
                                    f"(openglm reads {allowed[0]!r} block-quantised checkpoints)")
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise QuantizationError(f"quantization_config.weight_block_size={block!r}: expected two positive integers")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise QuantizationError(f"quantization_config.modules_to_not_convert={skip!r}: expected a list of names")
    return Fp8Config(tuple(block), list(skip))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "") -> torch.Tensor:
    """fp8 [out, in] times its block's scale -> fp32 [out, in]."""
    if weight.dim() != 2 or tuple(scale_inv.shape) != scale_shape(tuple(weight.shape), block):
        raise QuantizationError(f"tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale_inv.shape)}, but "
                                f"{name!r} {tuple(weight.shape)} in blocks of {list(block)} needs "
                                f"{scale_shape(tuple(weight.shape), block) if weight.dim() == 2 else '2-D'}")
    out, inp = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * scale


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv [blocks]) with each block's largest |w|
    mapped to E4M3_MAX (a zero block gets scale 1)."""
    w = weight.float()
    out, inp = w.shape
    rows, cols = scale_shape((out, inp), block)
    padded = w.new_zeros(rows * block[0], cols * block[1])
    padded[:out, :inp] = w
    tiles = padded.view(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view_as(padded)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
