"""Engine configuration: one typed dataclass, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

from openglm.util.dtypes import dtype_name


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block (vLLM's --block-size)
    num_kv_blocks: int = 512  # size of the paged KV pool, in blocks
    max_num_seqs: int = 32  # sequences running in one step
    max_num_batched_tokens: int = 2048  # tokens (prefill + decode) computed in one step
    # a request's fair share: while other requests wait, its sequences beyond this many wait behind theirs
    # (and are preempted if they hold the room the others need); alone, a request may use every slot
    max_seqs_per_request: int = 8
    max_model_len: int | None = None  # prompt + output; defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True  # content-hashed full blocks shared across requests (session cache)
    session_ttl: float = 600.0  # seconds an idle cached block may stay reusable; <= 0 disables expiry
    quantization: str | None = None  # None, "int8", "int4" (weight-only, read in place by the CPU kernels) or "fp8"
    dtype: str = "float32"
    seed: int = 0
    num_speculative_tokens: int = 0  # MTP drafts verified per decode step (0: off); needs a next-n layer
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the weights, the paged KV pool and the steps run

    def __post_init__(self):
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_seqs_per_request"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be an integer >= 0, got "
                             f"{self.num_speculative_tokens!r}")
        if self.quantization not in (None, "none", "int8", "int4", "fp8"):
            raise ValueError(f"EngineConfig.quantization must be none, int8, int4 or fp8, got {self.quantization!r}")
        if self.quantization == "none":
            self.quantization = None
        self.dtype = dtype_name(self.dtype, what="EngineConfig.dtype")  # bf16, fp32, fp16 spelled either way
        if not isinstance(self.device, str) or not DEVICE.fullmatch(self.device):
            raise ValueError(f"EngineConfig.device must be cpu, cuda or cuda:N, got {self.device!r}")


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def resolve_device(name: str):
    """The torch device `name` (cpu, cuda, cuda:N) names; ValueError in one line when it is not there."""
    import torch  # heavy: only when an engine is built (`openglm serve --help` stays fast)

    if not DEVICE.fullmatch(name):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {name!r}: no CUDA device is available (torch {torch.__version__}, {build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device
