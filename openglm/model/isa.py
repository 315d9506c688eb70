"""What this CPU's instruction set lets the inference paths use, and the choices made from it.

Two CPU kinds run this project: AMD EPYC (Zen 4: AVX-512 with BF16 and VNNI, no AMX) and Intel Xeon with AMX
(tile matrix units for bf16 and int8). The native decode kernels are built `-march=native` and use AVX-512 on both
(a decode step's 1-8 rows are too few for 16-row tiles). A prefill's routed experts differ:
- with AMX, oneDNN's matmul runs bf16 on the tiles (`brg_matmul:avx10_1_512_amx`) when it is called with
  weights it can reorder; ATen's grouped matmul does not reach it. `experts_path` picks "onednn": each expert's
  gate, up and down weights packed once into oneDNN's layout (`fast.onednn_experts`, cached with the weights),
  gate with SiLU fused and up with the product fused into its matmul;
- without AMX, "grouped" (torch._grouped_mm: two calls for all experts), which measured as fast as the packed
  oneDNN path on the EPYC (docs/model.md, "CPU kinds") without a second copy of the expert weights.
OPENGLM_EXPERTS=onednn|grouped overrides the choice (benchmarks, tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuFeatures:
    amx: bool  # AMX tiles with bf16 (cpuid via torch's cpuinfo; /proc/cpuinfo amx_bf16 where readable)
    avx512_bf16: bool
    vnni: bool


def _cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), None)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    flags = _cpuinfo_flags()
    amx = torch.cpu._is_amx_tile_supported() and (flags is None or "amx_bf16" in flags)
    return CpuFeatures(amx=bool(amx), avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
                       vnni=bool(torch.cpu._is_vnni_supported()))


EXPERT_PATHS = ("grouped", "onednn")


def experts_path(features: CpuFeatures | None = None) -> str:
    """How a bf16 prefill runs its routed experts on this CPU: "onednn" with AMX, else "grouped" (see above)."""
    forced = os.environ.get("OPENGLM_EXPERTS")
    if forced in EXPERT_PATHS:
        return forced
    features = features or cpu_features()
    return "onednn" if features.amx and torch.backends.mkldnn.is_available() else "grouped"
