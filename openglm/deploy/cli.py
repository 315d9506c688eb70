"""`openglm serve` (the OpenAI-compatible server) and `openglm deploy` (its vLLM / SGLang launch).

Both read a deployment (`DeployConfig`): `serve` from deploy.yaml (`--config`) or from CHECKPOINT and its
engine flags, `deploy` from deploy.yaml. The heavy imports (torch, the engine, uvicorn) happen in the handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
from dataclasses import fields
from pathlib import Path

from openglm.deploy.config import (
    OPENGLM_DEFAULTS,
    DeployConfig,
    DeployConfigError,
    SessionCache,
    Speculative,
    load_deploy_config,
)
from openglm.server.limits import ServerLimits
from openglm.util.auth import is_loopback
from openglm.util.dtypes import argparse_dtype

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


D = " (default %(default)s)"
# the server's own limits (ServerLimits): flag, field, type, what it limits
LIMIT_FLAGS = [
    ("--max-queue", "max_queue", int, "requests in flight before answering 503 + Retry-After"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body in bytes; larger ones get 413"),
    ("--body-timeout", "body_timeout_s", float, "seconds a whole request body may take (plus 1 s per --min-body-rate "
                                                "bytes received) before 408"),
    ("--min-body-rate", "min_body_rate", int, "bytes per second a request body is granted beyond --body-timeout"),
    ("--header-timeout", "header_timeout_s", float, "seconds a connection has to send its request head"),
    ("--keep-alive-timeout", "keep_alive_s", int, "seconds an idle keep-alive connection stays open"),
    ("--limit-concurrency", "limit_concurrency", int, "requests being answered (body received) beyond which new ones "
                                                      "get 503"),
    ("--max-connections", "max_connections", int, "open connections; beyond it the one waiting longest without a "
                                                  "complete request is closed"),
    ("--prepare-workers", "prepare_workers", int, "worker processes that render chat templates, tokenise prompts "
                                                  "and check output grammars"),
    ("--template-timeout", "template_timeout_s", float, "seconds one request's chat template may render for (400)"),
    ("--grammar-timeout", "grammar_timeout_s", float, "seconds one request's output grammar may compile for (400)"),
]
DEPLOY = {f.name: f.default for f in fields(DeployConfig)}  # the defaults of a deployment: one set for both


def own(name: str) -> str:
    """Help text of a tuning flag: left out it is None, which openglm's engine resolves to OPENGLM_DEFAULTS."""
    return f" (default {OPENGLM_DEFAULTS[name]})"


def register(subparsers):
    register_serve(subparsers)
    register_deploy(subparsers)


# ---- openglm serve ----------------------------------------------------------------------------------
def register_serve(subparsers):
    p = subparsers.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible HTTP API",
                              description="Serve a checkpoint with the paged-KV engine behind the OpenAI API "
                                          "(/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (config.json, safetensors, tokenizer.json); "
                                                 "omit it with --config")
    p.add_argument("--config", default=None, metavar="DEPLOY_YAML",
                   help="serve the deployment a deploy.yaml describes (model, parallel_config, batching, block size, "
                        "quantization, session cache); under torchrun --nproc_per_node=TP it runs tensor/expert "
                        "parallel with rank 0 serving HTTP; the API key, request limits, --tokenizer, --threads and "
                        "--log-level flags then still apply, the engine and address flags do not. Default: none (serve "
                        "CHECKPOINT with the flags below)")
    p.add_argument("--host", default=DEPLOY["host"], help="address to listen on; 0.0.0.0 = all interfaces"+D)
    p.add_argument("--port", type=int, default=DEPLOY["port"], help="TCP port"+D)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' (default: "
                        "$OPENGLM_API_KEY, else no key; a key is required off loopback)")
    p.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: argv is visible in `ps`
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve on a non-loopback address without a key (default: refuse to)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the key (default: /metrics needs the key when one is set)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: folder name)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block" + own("block_size"))
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks in the paged pool" + own("num_kv_blocks"))
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences batched per step" + own("max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens computed per step (prefill chunk + decodes)" + own("max_num_batched_tokens"))
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens, prompt + output (default: the model's max_position_embeddings)")
    for flag, name, kind, text in LIMIT_FLAGS:
        p.add_argument(flag, dest=name, metavar=flag[2:].replace("-", "_").upper(), type=kind,
                       default=getattr(ServerLimits, name), help=text+D)
    p.add_argument("--session-ttl", type=float, default=SessionCache.ttl_s,
                   help="seconds an idle prefix-cache block stays reusable"+D)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix (session) cache")
    p.add_argument("--quantization", choices=["none", "int8", "int4", "fp8"], default="none",
                   help="weight-only quantisation (int8 and int4 read in place by the CPU kernels, fp8 dequantised "
                        "per op; an int4 checkpoint from `openglm convert --int4` loads as int4 without it)"+D)
    p.add_argument("--dtype", type=argparse_dtype(), default=None, metavar="DTYPE",
                   help="weight and compute dtype: fp32, bf16 or fp16 (also float32, bfloat16, float16)" + own("dtype"))
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="folder with tokenizer.json and the chat template, for a checkpoint saved without them "
                        "(default: the checkpoint's own)")
    p.add_argument("--device", default=DEPLOY["device"], metavar="DEVICE",
                   help="cpu, cuda or cuda:N: where the weights, the paged KV cache and the steps run; on CUDA the "
                        "MoE experts and DSA attention run Triton kernels (the `gpu` extra; docs/gpu.md)"+D)
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="self-speculative decoding: draft tokens the checkpoint's MTP (next-n) layer proposes per "
                        "decode step, verified in one forward (0: off; greedy output is unchanged)"+D)
    p.add_argument("--json-whitespace", choices=["compact", "flexible"], default=DEPLOY["json_whitespace"],
                   help="whitespace between the JSON tokens of constrained output (response_format, tool-call "
                        "arguments): none, or any run of it; a request's structured_outputs overrides it"+D)
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="chat-template switches for requests that set none, e.g. '{\"enable_thinking\": false}' "
                        "(GLM's enable_thinking, clear_thinking; vLLM's flag) (default: the template's own: thinking "
                        "on)")
    p.add_argument("--thinking-token-budget", type=int, default=None, metavar="N",
                   help="reasoning tokens after which </think> is forced, for requests that set no budget (default: "
                        "none; a constrained answer, forced tool call or response_format, thinks at most half its "
                        "max_tokens)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--log-level", default="info", help="uvicorn log level: debug, info, warning, error"+D)
    p.set_defaults(func=serve)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _refuses_without_key(args, api_key: str | None, host: str) -> bool:
    """True (after saying why) when a non-loopback address would be served without an API key."""
    if api_key is None and not is_loopback(host) and not args.allow_unauthenticated:
        print(f"openglm serve: refusing to serve on {host} without an API key: set ${KEY_ENV} or "
              f"--api-key-file PATH (or pass --allow-unauthenticated)", file=sys.stderr)
        return True
    return False


def serve_config(args) -> DeployConfig:
    """The deployment `openglm serve` runs: deploy.yaml's (--config), or CHECKPOINT with the engine and
    address flags."""
    if args.config is not None and args.checkpoint is not None:
        raise DeployConfigError("give either a CHECKPOINT or --config (the config names the model), not both")
    if args.config is not None:
        cfg = load_deploy_config(args.config)
        return dataclasses.replace(cfg, tokenizer=args.tokenizer) if args.tokenizer else cfg
    if args.checkpoint is None:
        raise DeployConfigError("give a CHECKPOINT folder or --config deploy.yaml")
    k = args.num_speculative_tokens
    return DeployConfig(
        model=args.checkpoint, served_model_name=args.served_model_name or Path(args.checkpoint).resolve().name,
        host=args.host, port=args.port, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, quantization=None if args.quantization == "none" else args.quantization,
        dtype=args.dtype, device=args.device, session_cache=SessionCache(not args.no_prefix_caching, args.session_ttl),
        speculative=Speculative(num_speculative_tokens=k) if k else None, json_whitespace=args.json_whitespace,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        thinking_token_budget=args.thinking_token_budget, tokenizer=args.tokenizer)


def serve(args) -> int:
    try:
        api_key = resolve_api_key(args)
        limits = ServerLimits(**{name: getattr(args, name) for _, name, _, _ in LIMIT_FLAGS})
        cfg = serve_config(args)
    except ValueError as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
    if _refuses_without_key(args, api_key, cfg.host):
        return 2
    # heavy (torch, the engine, uvicorn): loaded when serving, `openglm --help` stays fast
    import torch

    from openglm.deploy.launch import serve as serve_deployment
    from openglm.engine.config import resolve_device

    try:
        resolve_device(cfg.device)  # before loading anything: a missing GPU is named in one line
    except ValueError as exc:
        print(f"openglm serve: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    return serve_deployment(cfg, api_key, limits, public_metrics=args.public_metrics, log_level=args.log_level)


# ---- openglm deploy ---------------------------------------------------------------------------------
def register_deploy(subparsers):
    p = subparsers.add_parser(
        "deploy", help="print (or run) the vLLM / SGLang launch equivalent to a deploy.yaml",
        description="Map a deploy.yaml (parallel_config, batching, FP8, MTP) to the launch command of a GPU serving "
                    "engine, with the model family's recipe (published FP8 checkpoint, tool-call and reasoning "
                    "parsers, chat-template content format). Notes and warnings (fields the engine expresses "
                    "differently, a layout whose weights do not fit the GPU) go to stderr.")
    p.add_argument("config", help="deploy.yaml (see docs/scaling.md)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="target engine (default: vllm)")
    p.add_argument("--gpu", default=None, metavar="GPU",
                   help="the GPU the layout must fit (H100, H200, B200, ..., or e.g. 96GB); default: deploy.yaml's "
                        "gpu, else the weights per GPU are printed without a check")
    p.add_argument("--run", action="store_true", help="exec the command instead of printing it (default: print)")
    p.set_defaults(func=deploy)


def deploy(args) -> int:
    from openglm.deploy.handoff import launch_command  # the model's parameter accounting (torch) comes with it

    try:
        cfg = load_deploy_config(args.config)
        if args.gpu is not None:
            cfg = dataclasses.replace(cfg, gpu=args.gpu)
        argv, notes = launch_command(cfg, args.engine)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(note, file=sys.stderr)
    if not args.run:
        print(shlex.join(argv))
        return 0
    if shutil.which(argv[0]) is None:
        print(f"error: {argv[0]!r} is not on PATH: install {args.engine} on the GPU host, or drop --run to print "
              "the command", file=sys.stderr)
        return 1
    sys.stdout.flush()
    os.execvp(argv[0], argv)
