"""Parallel layouts: how a model is split over processes, checked against its config before any
process group starts, and what each rank then holds.

A layout names four degrees (the write-ups' `parallel_config` uses the long names):
- dp (data_parallel): training ranks, each with its own slice of the global batch; dense weights,
  gradients and AdamW state are sharded over them with FSDP2.
- ep (expert_parallel): the routed experts are split into `ep` equal groups; a rank holds
  `n_routed_experts / ep` of them, and tokens travel to their experts (all-to-all in training).
  ep borrows its ranks from dp (training) or tp (serving), as in torchtitan and vLLM: it must divide them.
- tp (tensor_parallel): serving ranks that split attention heads and dense MLP columns (all-reduce).
- pp (pipeline_parallel): not implemented by openglm's engine; refused with a pointer to the hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from openglm.model.config import ModelConfig
from openglm.model.errors import ConfigError
from openglm.model.model import build_model

LONG_NAMES = {"data_parallel": "dp", "expert_parallel": "ep", "tensor_parallel": "tp", "pipeline_parallel": "pp"}


class LayoutError(ConfigError):
    """A parallel layout that does not fit the model or the job (raised before any process group starts)."""


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel layout: {f.name}={value!r} must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """'dp=4,ep=2' (also 'tensor_parallel=4,...'); an empty string is the single-process layout."""
        values = {}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, sep, value = item.partition("=")
            key = LONG_NAMES.get(key.strip(), key.strip())
            if not sep or key not in {f.name for f in fields(cls)}:
                raise LayoutError(f"parallel layout {text!r}: expected KEY=N items with KEY in dp, ep, tp, pp")
            try:
                values[key] = int(value)
            except ValueError:
                raise LayoutError(f"parallel layout {text!r}: {key}={value!r} is not an integer") from None
        return cls(**values)

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelLayout":
        """The write-ups' `parallel_config` mapping (long or short keys)."""
        unknown = sorted(set(d) - set(LONG_NAMES) - set(LONG_NAMES.values()))
        if unknown:
            raise LayoutError(f"parallel_config: unknown key(s) {unknown} (known: {sorted(LONG_NAMES)})")
        return cls(**{LONG_NAMES.get(k, k): v for k, v in d.items()})

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def check_training_layout(layout: ParallelLayout, cfg: ModelConfig, world: int | None = None) -> None:
    """Raise LayoutError unless `layout` can train `cfg` on `world` processes (dp = world)."""
    if layout.tp > 1 or layout.pp > 1:
        raise LayoutError(f"training layout {layout}: openglm trains with dp (FSDP2) and ep only; tensor and pipeline "
                          "parallel training are not implemented (use dp and ep, or Megatron-style frameworks)")
    _check_experts(layout, cfg)
    _check_ranks(layout, "training", "dp", world, "expert-parallel groups are made of data-parallel ranks")


def check_serving_layout(layout: ParallelLayout, cfg: ModelConfig, world: int | None = None) -> None:
    """Raise LayoutError unless `layout` can serve `cfg` on `world` processes (tp = world)."""
    if layout.pp > 1:
        raise LayoutError(f"serving layout {layout}: pipeline parallelism is not implemented by openglm's engine; "
                          "use pipeline_parallel: 1, or hand the deployment to vLLM/SGLang with "
                          "`openglm deploy CONFIG --engine vllm`, which pipeline-parallelise")
    if layout.dp > 1:
        raise LayoutError(f"serving layout {layout}: data-parallel serving is N independent servers; run N "
                          "`openglm serve` processes behind a load balancer (data_parallel: 1 here)")
    _check_experts(layout, cfg)
    shards = {"num_attention_heads": cfg.num_attention_heads}
    if any(t == "dense" for t in cfg.mlp_layer_types):
        shards["intermediate_size"] = cfg.intermediate_size
    if cfg.moe_layers and cfg.n_shared_experts:
        shards["moe_intermediate_size * n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    for name, size in shards.items():
        if size % layout.tp:
            raise LayoutError(f"serving layout {layout}: tp={layout.tp} does not divide {name}={size}")
    _check_ranks(layout, "serving", "tp", world, "expert shards are spread over the tensor-parallel ranks")


def _check_ranks(layout: ParallelLayout, kind: str, degree: str, world: int | None, why: str) -> None:
    """ep divides the degree that sets the process count (dp or tp), which must equal the job's `world`."""
    ranks = getattr(layout, degree)
    if ranks % layout.ep:
        raise LayoutError(f"{kind} layout {layout}: ep={layout.ep} must divide {degree}={ranks} ({why})")
    if world is not None and world != ranks:
        raise LayoutError(f"{kind} layout {layout} needs {degree}={ranks} processes, this job has {world} "
                          f"(launch with torchrun --nproc_per_node={ranks})")


def _check_experts(layout: ParallelLayout, cfg: ModelConfig) -> None:
    if layout.ep > 1 and not cfg.moe_layers:
        raise LayoutError(f"layout {layout}: ep={layout.ep} but the model has no MoE layers")
    if cfg.moe_layers and cfg.n_routed_experts % layout.ep:
        raise LayoutError(f"layout {layout}: ep={layout.ep} does not divide n_routed_experts={cfg.n_routed_experts}")


# ---- memory per rank -------------------------------------------------------------------------------

TP_SHARDED = (".self_attn.q_b_proj.", ".self_attn.kv_b_proj.", ".self_attn.o_proj.", ".mlp.shared_experts.")
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + fp32 gradient + AdamW's two fp32 moments


def rank_parameters(cfg: ModelConfig, layout: ParallelLayout, mode: str) -> dict[str, float]:
    """Parameters one rank holds, per component ("routed_experts", "tp_sharded", "replicated" / "fsdp_sharded"),
    for mode "serve" (tp/ep) or "train" (FSDP2 over dp, experts over ep). Built on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg)
    dense_layers = {i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"}
    out = {"routed_experts": 0.0,
           **({"tp_sharded": 0.0, "replicated": 0.0} if mode == "serve" else {"fsdp_sharded": 0.0})}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        if ".mlp.experts." in name:
            out["routed_experts"] += n / layout.ep
        elif mode == "train":
            out["fsdp_sharded"] += n / layout.dp
        elif any(s in name for s in TP_SHARDED) or _dense_mlp(name, dense_layers):
            out["tp_sharded"] += n / layout.tp
        else:
            out["replicated"] += n
    return out


def _dense_mlp(name: str, dense_layers: set[int]) -> bool:
    parts = name.split(".")
    return len(parts) > 3 and parts[3] == "mlp" and int(parts[2]) in dense_layers


def memory_report(cfg: ModelConfig, layout: ParallelLayout) -> dict:
    """Weights per rank (GiB) when serving at bf16 / fp8, and training bytes per rank (fp32 + AdamW),
    for the layout; KV cache and activations are extra."""
    serve = rank_parameters(cfg, layout, "serve") if layout.tp > 1 or layout.dp == 1 else None
    train = rank_parameters(cfg, layout, "train") if layout.tp == 1 else None
    report = {"layout": str(layout)}
    if serve is not None:
        total = sum(serve.values())
        report["serve"] = {"ranks": layout.tp, "params_per_rank": serve, "total_params_per_rank": total,
                           "bf16_gib": total * 2 / 2**30, "fp8_gib": total / 2**30}
    if train is not None:
        total = sum(train.values())
        report["train"] = {"ranks": layout.dp, "params_per_rank": train, "total_params_per_rank": total,
                           "fp32_adamw_gib": total * TRAIN_BYTES_PER_PARAM / 2**30}
    return report


def format_memory_report(report: dict) -> str:
    lines = [f"  per-rank memory for layout {report['layout']} (weights only; KV cache and activations extra):"]
    for mode, unit in (("serve", ("bf16_gib", "fp8_gib")), ("train", ("fp32_adamw_gib",))):
        r = report.get(mode)
        if r is None:
            continue
        parts = ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in r["params_per_rank"].items())
        sizes = ", ".join(f"{u.removesuffix('_gib')} {r[u]:,.1f} GiB" for u in unit)
        lines.append(f"    {mode:<5} ({r['ranks']} ranks): {r['total_params_per_rank'] / 1e9:.2f}B params/rank "
                     f"[{parts}] -> {sizes}")
    return "\n".join(lines)
