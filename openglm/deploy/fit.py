"""Does a hand-off's layout fit the GPU it names? Weights per GPU from the model's parameter split (the same
accounting as `openglm info --parallel`), as the GPU engines shard them, and the smallest layout that fits.

vLLM and SGLang spread the routed experts over every tensor-parallel GPU whatever the expert-parallel degree
(vLLM: expert parallel over tp x dp ranks, or each expert tensor-split; SGLang: `--ep-size` groups, each
expert tensor-split inside its group), so a GPU holds experts / (tp, or tp x dp under vLLM's expert
parallelism), the attention heads and dense MLPs split tp ways, the replicated rest whole, and 1/pp of it all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from openglm.model.config import ModelConfig
from openglm.model.parallel import LayoutError, ParallelLayout, check_serving_layout, rank_parameters

GIB = 2**30
UTILISATION = 0.9  # vLLM's default --gpu-memory-utilization: the share of a GPU the engine fills
WEIGHT_SHARE = 0.8  # of that budget, weights beyond this leave the KV cache too little for long contexts
NODE_GPUS = 8  # GPUs per node: a suggested layout past this pipelines over nodes


@dataclass(frozen=True)
class Split:
    """Parameters of one model by how the engines shard them."""

    experts: float  # routed experts
    tensor: float  # split tp ways (attention heads, dense MLPs, shared experts)
    replicated: float  # every GPU holds them (embeddings, LM head, norms, routers, indexer, low-rank projections)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Split":
        p = rank_parameters(cfg, ParallelLayout(), "serve")  # tp = ep = 1: the totals of each part
        return cls(p["routed_experts"], p["tp_sharded"], p["replicated"])

    def per_gpu(self, tp: int, expert_ranks: int, pp: int = 1) -> float:
        """Parameters one GPU holds: `openglm info --parallel tp=TP,ep=EXPERT_RANKS`, split over pp stages."""
        return (self.experts / expert_ranks + self.tensor / tp + self.replicated) / pp


@functools.cache
def preset_split(name: str) -> Split:
    """A preset's Split, built once per process (the 744B glm-5 shape takes a meta-device model build)."""
    return Split.of(ModelConfig.from_preset(name))


@dataclass(frozen=True)
class Fit:
    gib_per_gpu: float  # weights only
    budget_gib: float  # UTILISATION of the GPU's memory
    suggestion: str | None  # a layout that fits, when this one does not (or leaves the KV cache too little)

    @property
    def fits(self) -> bool:
        return self.gib_per_gpu <= self.budget_gib

    @property
    def tight(self) -> bool:
        return self.gib_per_gpu > WEIGHT_SHARE * self.budget_gib


def budget_gib(gpu_gb: float) -> float:
    return gpu_gb * 1e9 / GIB * UTILISATION


def suggest_layout(split: Split, cfg: ModelConfig, bytes_per_param: float, gpu_gb: float) -> str | None:
    """The fewest GPUs whose weights stay within WEIGHT_SHARE of the budget: tensor parallel on one node,
    then 8-way tensor parallel pipelined over nodes."""
    limit = WEIGHT_SHARE * budget_gib(gpu_gb)
    for tp, pp in [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (8, 3), (8, 4), (8, 6), (8, 8)]:
        try:  # the engines need tp to divide the heads and the MLP widths, as openglm's serving does
            check_serving_layout(ParallelLayout(tp=tp, ep=tp), cfg)
        except LayoutError:
            continue
        gib = split.per_gpu(tp, tp, pp) * bytes_per_param / GIB
        if gib <= limit:
            where = f"{tp * pp} GPUs" if pp == 1 else f"{pp} nodes x {tp} GPUs"
            layout = f"tensor_parallel: {tp}" + (f", pipeline_parallel: {pp}" if pp > 1 else "")
            return f"parallel_config: {{{layout}}} ({where}, {gib:,.1f} GiB of weights per GPU)"
    return None


def check_fit(split: Split, cfg: ModelConfig, tp: int, expert_ranks: int, pp: int, bytes_per_param: float,
              gpu_gb: float) -> Fit:
    gib = split.per_gpu(tp, expert_ranks, pp) * bytes_per_param / GIB
    fit = Fit(gib, budget_gib(gpu_gb), None)
    if fit.tight:
        fit = Fit(gib, fit.budget_gib, suggest_layout(split, cfg, bytes_per_param, gpu_gb))
    return fit
