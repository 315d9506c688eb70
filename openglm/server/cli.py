"""`openglm serve CHECKPOINT`: the OpenAI-compatible server (the heavy imports happen in the handler)."""

from __future__ import annotations


def register(subparsers):
    p = subparsers.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible HTTP API",
                              description="Serve a checkpoint with the paged-KV engine behind the OpenAI API "
                                          "(/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--config", default=None, metavar="DEPLOY_YAML",
                   help="serve the deployment a deploy.yaml describes (model, parallel_config, batching, block size, "
                        "quantization, session cache); under torchrun --nproc_per_node=TP it runs tensor/expert "
                        "parallel with rank 0 serving HTTP; of the flags below only --api-key, --threads and --log-level then "
                        "apply. Default: none (serve CHECKPOINT with the flags below)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                                                   "(default: $OPENGLM_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: folder name)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks in the paged pool")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences batched per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens computed per step")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + output)")
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before answering 429")
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle prefix-cache block stays reusable")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix (session) cache")
    p.add_argument("--quantization", choices=["none", "int8", "fp8"], default="none",
                   help="weight-only quantisation (dequantised for compute)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=serve)


def serve(args) -> int:
    if args.config is not None or args.checkpoint is None:
        return _serve_config(args)
    import os
    import sys
    from pathlib import Path

    import torch  # heavy: loaded when serving, `openglm --help` stays fast
    import uvicorn

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.server.app import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, session_ttl=args.session_ttl,
        max_queue=args.max_queue, quantization=args.quantization, dtype=args.dtype)
    try:
        engine = LLMEngine.from_pretrained(args.checkpoint, config)
    except (OSError, ValueError) as exc:
        print(f"openglm serve: cannot load {args.checkpoint}: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    app = create_app(engine, name, api_key=args.api_key or os.environ.get("OPENGLM_API_KEY"))
    print(f"openglm serve: {name} on http://{args.host}:{args.port} "
          f"({config.num_kv_blocks} KV blocks x {config.block_size} tokens, max_model_len {engine.max_model_len})",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _serve_config(args) -> int:
    import sys  # with the heavy imports below: this module is imported by `openglm --help`

    if args.config is None:
        print("openglm serve: give a CHECKPOINT folder or --config deploy.yaml", file=sys.stderr)
        return 2
    if args.checkpoint is not None:
        print("openglm serve: give either a CHECKPOINT or --config (the config names the model), not both",
              file=sys.stderr)
        return 2
    # heavy (torch, the engine, uvicorn): loaded when serving, `openglm --help` stays fast
    import torch

    from openglm.server.deploy_config import load_deploy_config
    from openglm.server.launch import serve_deploy

    if args.threads:
        torch.set_num_threads(args.threads)
    try:

        return serve_deploy(load_deploy_config(args.config), api_key=args.api_key, log_level=args.log_level)
    except (OSError, ValueError) as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
