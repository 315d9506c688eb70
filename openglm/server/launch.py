"""`openglm serve --config deploy.yaml`: one process, or tensor/expert parallel under
`torchrun --nproc_per_node=TP` (rank 0 serves HTTP, the others follow its model steps)."""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import uvicorn

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.quant import quantize_model
from openglm.tokenizer import Tokenizer
from openglm.engine.model_runner import ModelRunner
from openglm.engine.parallel import BroadcastingModelRunner, exit_rank, follow_steps, shard_for_serving
from openglm.model.checkpoint import load_model, read_config, resolve_checkpoint
from openglm.model.parallel import check_serving_layout
from openglm.server.app import create_app
from openglm.server.deploy_config import DeployConfig
from openglm.server.limits import ServerLimits, uvicorn_config


IDLE_TIMEOUT = timedelta(days=365)  # followers wait in a broadcast between requests: never time them out


def engine_config(cfg: DeployConfig) -> EngineConfig:
    return EngineConfig(block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks, max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
                        enable_prefix_caching=cfg.session_cache.enabled, session_ttl=cfg.session_cache.ttl_s,
                        quantization=cfg.quantization, dtype=cfg.dtype,
                        num_speculative_tokens=cfg.speculative.num_speculative_tokens if cfg.speculative else 0)


def unused_fields(cfg: DeployConfig, speculating: bool = True) -> list[str]:
    """Fields the hand-off engines use and openglm's own engine does not (said once at start)."""
    notes = []
    if cfg.speculative is not None and not speculating:
        notes.append("speculative (MTP) decoding runs in a single-process openglm engine on a checkpoint with a "
                     "next-n layer; this one decodes one token a step (tensor-parallel ranks, or no MTP layer)")
    if cfg.tool_call_parser or cfg.reasoning_parser:
        notes.append("tool_call_parser / reasoning_parser name the vLLM/SGLang parsers; openglm serve renders "
                     "GLM tool calls and reasoning with its own chat template")
    return notes


def build_parallel_engine(cfg: DeployConfig):
    """Every rank: load, shard, quantise. Returns the LLMEngine on rank 0 and a plain ModelRunner elsewhere.
    The layout is checked against the checkpoint's config before any process group starts."""
    path = resolve_checkpoint(cfg.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_serving_layout(cfg.layout, read_config(path), world)
    if world > 1 and not dist.is_initialized():
        # gloo: openglm's engine runs on the CPU (GPU serving is the vLLM/SGLang hand-off)
        dist.init_process_group("gloo", timeout=IDLE_TIMEOUT)
    config = engine_config(cfg)
    model = shard_for_serving(load_model(str(path), dtype=getattr(torch, config.dtype)), cfg.layout)
    if world > 1 or not len(model.model.mtp_layers):  # ranks > 0 follow `execute` calls only: no MTP calls
        config = dataclasses.replace(config, num_speculative_tokens=0)
    if config.quantization:
        quantize_model(model, config.quantization)
    tokenizer = Tokenizer.from_checkpoint(path)
    if dist.is_initialized() and dist.get_rank() > 0:
        return ModelRunner(model, config.num_kv_blocks, config.block_size, getattr(tokenizer, "pad_id", 0))
    engine = LLMEngine(model, tokenizer, config)
    if dist.is_initialized():
        engine.runner = BroadcastingModelRunner(model, config.num_kv_blocks, config.block_size,
                                                getattr(tokenizer, "pad_id", 0))
    return engine


def serve_deploy(cfg: DeployConfig, api_key: str | None, limits: ServerLimits, public_metrics: bool = False,
                 log_level: str = "info") -> int:
    built = build_parallel_engine(cfg)
    if isinstance(built, ModelRunner):  # a follower rank
        follow_steps(built)
        exit_rank()
    for note in unused_fields(cfg, built.config.num_speculative_tokens > 0):
        print(f"openglm serve: note: {note}", file=sys.stderr)
    app = create_app(built, cfg.name, api_key=api_key, public_metrics=public_metrics, limits=limits)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    print(f"openglm serve: {cfg.name} on http://{cfg.host}:{cfg.port} (layout {cfg.layout}, {ranks} rank(s); "
          f"{cfg.num_kv_blocks} KV blocks x {cfg.block_size} tokens, max_model_len {built.max_model_len})", flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, cfg.host, cfg.port, limits, log_level)).run()
    finally:
        if isinstance(built.runner, BroadcastingModelRunner):
            built.runner.stop_followers()
    if isinstance(built.runner, BroadcastingModelRunner):
        exit_rank()  # rank 0 of a torchrun job, the server stopped cleanly
    return 0
