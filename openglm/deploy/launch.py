"""`openglm serve`: a deployment as a running server, on one process or tensor/expert parallel under
`torchrun --nproc_per_node=TP` (rank 0 serves HTTP, the others follow its model steps)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import uvicorn

from openglm.deploy.config import DeployConfig, engine_config, unused_fields
from openglm.engine import LLMEngine
from openglm.engine.model_runner import ModelRunner
from openglm.engine.parallel import BroadcastingModelRunner, check_shardable, exit_rank, follow_steps, shard_for_serving
from openglm.engine.quant import quantize_model
from openglm.model.checkpoint import load_model, read_config, resolve_checkpoint
from openglm.model.errors import ModelError
from openglm.model.parallel import check_serving_layout
from openglm.server.app import create_app
from openglm.server.limits import ServerLimits
from openglm.tokenizer import Tokenizer, tokenizer_folder
from openglm.util.http_limits import uvicorn_config

IDLE_TIMEOUT = timedelta(days=365)  # followers wait in a broadcast between requests: never time them out


def build_engine(cfg: DeployConfig) -> LLMEngine | ModelRunner:
    """Every rank: load, shard, quantise. Returns the LLMEngine on rank 0 and a plain ModelRunner elsewhere.
    The layout is checked against the checkpoint's config before any process group starts."""
    path = resolve_checkpoint(cfg.model)
    tokenizer_dir = tokenizer_folder(path, cfg.tokenizer)  # a folder without one is named before any weight is read
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_cfg = read_config(path)
    check_serving_layout(cfg.layout, model_cfg, world)
    check_shardable(model_cfg, world)  # what openglm's own engine can shard (vLLM/SGLang may do more)
    config = engine_config(cfg, world)
    if world == 1:
        return LLMEngine.from_pretrained(path, config, tokenizer=tokenizer_dir)
    if config.device != "cpu":
        raise ValueError(f"device {config.device!r}: tensor/expert-parallel serving runs on the CPU (gloo); a GPU "
                         "serves one process")
    if not dist.is_initialized():
        # gloo: openglm's engine runs on the CPU (GPU serving is the vLLM/SGLang hand-off)
        dist.init_process_group("gloo", timeout=IDLE_TIMEOUT)
    model = shard_for_serving(load_model(str(path), dtype=getattr(torch, config.dtype)), cfg.layout)
    if config.quantization:
        quantize_model(model, config.quantization)
    tokenizer = Tokenizer.from_checkpoint(tokenizer_dir)
    runner_type = ModelRunner if dist.get_rank() > 0 else BroadcastingModelRunner
    runner = runner_type(model, config.num_kv_blocks, config.block_size, getattr(tokenizer, "pad_id", 0))
    return runner if dist.get_rank() > 0 else LLMEngine(model, tokenizer, config, runner=runner)


def serve(cfg: DeployConfig, api_key: str | None, limits: ServerLimits, public_metrics: bool = False,
          log_level: str = "info") -> int:
    """Build the engine, then serve HTTP until stopped (a follower rank replays rank 0's steps instead)."""
    try:
        built = build_engine(cfg)
    except (OSError, ValueError, ModelError) as exc:  # ModelError: every checkpoint/config problem the loader names
        print(f"openglm serve: cannot load {cfg.model}: {exc}", file=sys.stderr)
        return 2
    if isinstance(built, ModelRunner):  # a follower rank
        follow_steps(built)
        exit_rank()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    for note in [*unused_fields(cfg, ranks), *built.notes]:  # the engine's: e.g. a hybrid model's settings
        print(f"openglm serve: note: {note}", file=sys.stderr)
    app = create_app(built, cfg.name, api_key=api_key, public_metrics=public_metrics, limits=limits,
                     json_whitespace=cfg.json_whitespace, default_chat_template_kwargs=cfg.default_chat_template_kwargs,
                     thinking_token_budget=cfg.thinking_token_budget)
    print(f"openglm serve: {cfg.name} on http://{cfg.host}:{cfg.port} (layout {cfg.layout}, {ranks} rank(s); "
          f"{cfg.own('num_kv_blocks')} KV blocks x {cfg.own('block_size')} tokens, max_model_len "
          f"{built.max_model_len})", flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, cfg.host, cfg.port, limits, log_level)).run()
    finally:
        if isinstance(built.runner, BroadcastingModelRunner):
            built.runner.stop_followers()
    if isinstance(built.runner, BroadcastingModelRunner):
        exit_rank()  # rank 0 of a torchrun job, the server stopped cleanly
    return 0
