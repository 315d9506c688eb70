"""int4 weight-only checkpoints: openglm's layout, written by `openglm convert --int4`.

config.json carries
    "quantization_config": {"quant_method": "openglm_int4", "bits": 4, "group_size": 32, "symmetric": true,
                            "scale_dtype": "bfloat16", "packing": "openglm_int4_blocks",
                            "modules_to_not_convert": [...]}
and each quantised weight W [out, in] is stored as `NAME.weight` (uint8 [out, in / 2], the codes packed as
`quantized.pack_int4` lays them out: per row, blocks of 64 codes in 32 bytes, byte j = code j | code 32 + j << 4, a
last block of 32 codes in 16 bytes when in is an odd multiple of 32) plus `NAME.weight_scale` (bf16 [out, in /
group_size]): W[o, i] = (code - 8) * scale[o, i // group_size]. The codes are the ones `quantized.quantize_int4`
chooses (GGML's Q4_0 rule), so the decode kernels read them in place after loading: no repacking.
Embeddings, the MoE routers, the DSA indexer's head weights, the next-n layers' copies of the embedding and head, and
any weight whose width the group does not divide stay in the checkpoint dtype. Routed experts are stored per expert,
as the unquantised layout stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openglm.model.errors import QuantizationError
from openglm.model.quantized import INT4_GROUPS, QuantizedWeight, quantize_int4

METHOD = "openglm_int4"
PACKING = "openglm_int4_blocks"
SCALE_SUFFIX = "_scale"
DEFAULT_GROUP = 32
# Modules kept unquantised (dotted components of the module name): embeddings, MoE routers (a router's few rows pick
# the experts), the indexer's head weights (GLM keeps them in fp32), the next-n layers' embedding / head copies.
DEFAULT_NOT_CONVERT = ["embed_tokens", "mlp.gate", "indexer.weights_proj", "shared_head"]


def keeps(name: str, modules: list[str]) -> bool:
    """Whether the weight `name` (native or on-disk) belongs to one of `modules`, matched on whole dotted names."""
    padded = f".{name.removesuffix('.weight')}."
    return any(f".{m}." in padded for m in modules)


@dataclass
class Int4Config:
    group: int = DEFAULT_GROUP
    modules_to_not_convert: list[str] = field(default_factory=lambda: list(DEFAULT_NOT_CONVERT))

    def __post_init__(self):
        if self.group not in INT4_GROUPS:
            raise QuantizationError(f"int4 group size {self.group!r} is not one of {', '.join(map(str, INT4_GROUPS))}")

    def to_hf(self) -> dict:
        return {"quant_method": METHOD, "bits": 4, "group_size": self.group, "symmetric": True,
                "scale_dtype": "bfloat16", "packing": PACKING,
                "modules_to_not_convert": list(self.modules_to_not_convert)}

    def converts(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor is written as int4: a 2-D floating `.weight` outside modules_to_not_convert whose
        width the group divides."""
        return (hf_name.endswith(".weight") and tensor.dim() == 2 and tensor.is_floating_point()
                and tensor.shape[-1] % self.group == 0 and not keeps(hf_name, self.modules_to_not_convert))

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes, scales) to store for a weight `converts` accepts."""
        return quantize_int4(tensor, self.group)


def parse(qc: dict) -> Int4Config:
    """The Int4Config of an openglm_int4 quantization_config; QuantizationError names the key that is wrong."""
    expected = {"bits": 4, "symmetric": True, "scale_dtype": "bfloat16", "packing": PACKING}
    for key, value in expected.items():
        if qc.get(key) != value:
            raise QuantizationError(f"quantization_config.{key}={qc.get(key)!r} is not supported (openglm_int4 "
                                    f"checkpoints have {key}={value!r})")
    group = qc.get("group_size")
    if isinstance(group, bool) or group not in INT4_GROUPS:
        raise QuantizationError(f"quantization_config.group_size={group!r}: expected one of "
                                f"{', '.join(map(str, INT4_GROUPS))}")
    modules = qc.get("modules_to_not_convert", DEFAULT_NOT_CONVERT)
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise QuantizationError("quantization_config.modules_to_not_convert must be a list of module names")
    return Int4Config(group, list(modules))


def weight(name: str, codes: torch.Tensor, scale: torch.Tensor, cfg: Int4Config, dtype: torch.dtype,
           where: str) -> QuantizedWeight:
    """The int4 weight `name` from its stored codes and scales, or QuantizationError in one line naming the tensor
    and what does not fit (`where`: the file)."""
    ok = (codes.dtype == torch.uint8 and scale.dtype == torch.bfloat16 and codes.dim() == 2 and scale.dim() == 2
          and codes.shape[0] == scale.shape[0] and (2 * codes.shape[1]) % 32 == 0
          and scale.shape[1] * cfg.group == 2 * codes.shape[1])
    if not ok:
        raise QuantizationError(
            f"tensor {name!r} in {where}: int4 codes {tuple(codes.shape)} {codes.dtype} and scales "
            f"{name + SCALE_SUFFIX!r} {tuple(scale.shape)} {scale.dtype} do not fit group_size {cfg.group} (expected "
            f"uint8 [out, in/2] and bfloat16 [out, in/{cfg.group}], in a multiple of 32)")
    if not torch.isfinite(scale).all():
        raise QuantizationError(f"tensor {name + SCALE_SUFFIX!r} in {where} holds NaN or infinite scales")
    return QuantizedWeight(codes, scale, dtype)
