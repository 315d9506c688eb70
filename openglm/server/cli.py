"""`openglm serve CHECKPOINT`: the OpenAI-compatible server (the heavy imports happen in the handler)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from openglm.server.limits import ServerLimits

KEY_ENV = "OPENGLM_API_KEY"


class KeySetupError(ValueError):
    """A one-line reason the server will not start with this key set-up."""


def resolve_api_key(args) -> str | None:
    """The key from --api-key-file or $OPENGLM_API_KEY (never argv); None for no key."""
    if args.api_key is not None:
        raise KeySetupError(f"--api-key is no longer accepted (the key would be visible to every user in `ps`): "
                        f"put it in a file and pass --api-key-file PATH, or set ${KEY_ENV}")
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise KeySetupError(f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}") from exc
        if not key:
            raise KeySetupError(f"--api-key-file {args.api_key_file} is empty")
        return key
    if KEY_ENV in os.environ:
        key = os.environ[KEY_ENV].strip()
        if not key:
            raise KeySetupError(f"${KEY_ENV} is set but empty: unset it to serve without a key, or give it a value")
        return key
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve to anything
        return False


D = " (default %(default)s)"


def register(subparsers):
    p = subparsers.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible HTTP API",
                              description="Serve a checkpoint with the paged-KV engine behind the OpenAI API "
                                          "(/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (config.json, safetensors, tokenizer.json); "
                                                 "omit it with --config")
    p.add_argument("--config", default=None, metavar="DEPLOY_YAML",
                   help="serve the deployment a deploy.yaml describes (model, parallel_config, batching, block size, "
                        "quantization, session cache); under torchrun --nproc_per_node=TP it runs tensor/expert "
                        "parallel with rank 0 serving HTTP; the API key, request limits, --threads and --log-level "
                        "flags then still apply, the engine and address flags do not. Default: none (serve CHECKPOINT with the flags below)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 = all interfaces"+D)
    p.add_argument("--port", type=int, default=8000, help="TCP port"+D)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' (default: "
                        "$OPENGLM_API_KEY, else no key; a key is required off loopback)")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: argv is visible in `ps`
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback address without a key (default: refuse to)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the key (default: /metrics needs the key when one is set)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: folder name)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block"+D)
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks in the paged pool"+D)
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences batched per step"+D)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens computed per step"+D)
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens, prompt + output "
                                                                        "(default: the model's max_position_embeddings)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in flight before answering 503 + Retry-After (default: 256)")
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                   help=f"largest request body in bytes; larger ones get 413 (default: {ServerLimits.max_body_bytes})")
    p.add_argument("--body-timeout", type=float, default=ServerLimits.body_timeout_s,
                   help=f"seconds a request body may pause between chunks before 408 (default: "
                        f"{ServerLimits.body_timeout_s:g})")
    p.add_argument("--header-timeout", type=float, default=ServerLimits.header_timeout_s,
                   help=f"seconds a connection has to send its request head (default: {ServerLimits.header_timeout_s:g})")
    p.add_argument("--keep-alive-timeout", type=int, default=ServerLimits.keep_alive_s,
                   help=f"seconds an idle keep-alive connection stays open (default: {ServerLimits.keep_alive_s})")
    p.add_argument("--limit-concurrency", type=int, default=ServerLimits.limit_concurrency,
                   help=f"connections + tasks beyond which uvicorn answers 503 (default: {ServerLimits.limit_concurrency})")
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle prefix-cache block stays reusable"+D)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix (session) cache")
    p.add_argument("--quantization", choices=["none", "int8", "fp8"], default="none",
                   help="weight-only quantisation (int8 read in place by the decode kernels, fp8 dequantised per op)"+D)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weight and compute dtype"+D)
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="self-speculative decoding: draft tokens the checkpoint's MTP (next-n) layer proposes per "
                        "decode step, verified in one forward (0: off; greedy output is unchanged)"+D)
    p.add_argument("--json-whitespace", choices=["compact", "flexible"], default="compact",
                   help="whitespace between the JSON tokens of constrained output (response_format, tool-call "
                        "arguments): none, or any run of it; a request's structured_outputs overrides it"+D)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--log-level", default="info", help="uvicorn log level: debug, info, warning, error"+D)
    p.set_defaults(func=serve)


def _refuses_without_key(args, api_key: str | None, host: str) -> bool:
    """True (after saying why) when a non-loopback address would be served without an API key."""
    if api_key is None and not is_loopback(host) and not args.allow_unauthenticated:
        print(f"openglm serve: refusing to serve on {host} without an API key: set ${KEY_ENV} or "
              f"--api-key-file PATH (or pass --allow-unauthenticated)", file=sys.stderr)
        return True
    return False


def serve(args) -> int:
    try:
        api_key = resolve_api_key(args)
        limits = ServerLimits(args.max_body_bytes, args.body_timeout, args.header_timeout, args.keep_alive_timeout,
                              args.limit_concurrency)
    except ValueError as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
    if args.config is not None or args.checkpoint is None:
        return _serve_config(args, api_key, limits)
    if _refuses_without_key(args, api_key, args.host):
        return 2

    import torch  # heavy: loaded when serving, `openglm --help` stays fast
    import uvicorn

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.model.errors import ModelError
    from openglm.server.app import create_app
    from openglm.server.limits import uvicorn_config

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, session_ttl=args.session_ttl,
        max_queue=args.max_queue, quantization=args.quantization, dtype=args.dtype,
        num_speculative_tokens=args.num_speculative_tokens)
    try:
        engine = LLMEngine.from_pretrained(args.checkpoint, config)
    except (OSError, ValueError, ModelError) as exc:  # ModelError: every checkpoint/config problem the loader names
        print(f"openglm serve: cannot load {args.checkpoint}: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    app = create_app(engine, name, api_key=api_key, public_metrics=args.public_metrics, limits=limits,
                     json_whitespace=args.json_whitespace)
    print(f"openglm serve: {name} on http://{args.host}:{args.port} "
          f"({config.num_kv_blocks} KV blocks x {config.block_size} tokens, max_model_len {engine.max_model_len})",
          flush=True)
    uvicorn.Server(uvicorn_config(app, args.host, args.port, limits, args.log_level)).run()
    return 0


def _serve_config(args, api_key: str | None, limits: ServerLimits) -> int:
    """`--config deploy.yaml`: host, port and the engine come from the file; key and limits from the flags."""
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

    try:
        cfg = load_deploy_config(args.config)
    except ValueError as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
    if _refuses_without_key(args, api_key, cfg.host):
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return serve_deploy(cfg, api_key, limits, public_metrics=args.public_metrics, log_level=args.log_level)
    except (OSError, ValueError) as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
