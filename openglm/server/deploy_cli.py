"""`openglm deploy deploy.yaml --engine vllm|sglang [--run]`: the GPU-engine launch of a deployment."""

from __future__ import annotations

import os
import shlex
import shutil
import sys

from openglm.server.deploy_config import load_deploy_config
from openglm.server.handoff import launch_command


def register(subparsers):
    p = subparsers.add_parser(
        "deploy", help="print (or run) the vLLM / SGLang launch equivalent to a deploy.yaml",
        description="Map a deploy.yaml (parallel_config, batching, block size, FP8, MTP, GLM parsers) to the launch "
                    "command of a GPU serving engine. Fields the engine expresses differently are noted on stderr.")
    p.add_argument("config", help="deploy.yaml (see docs/scaling.md)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="target engine (default: vllm)")
    p.add_argument("--run", action="store_true", help="exec the command instead of printing it (default: print)")
    p.set_defaults(func=deploy)


def deploy(args) -> int:
    try:
        argv, notes = launch_command(load_deploy_config(args.config), args.engine)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if not args.run:
        print(shlex.join(argv))
        return 0
    if shutil.which(argv[0]) is None:
        print(f"error: {argv[0]!r} is not on PATH: install {args.engine} on the GPU host, or drop --run to print "
              "the command", file=sys.stderr)
        return 1
    sys.stdout.flush()
    os.execvp(argv[0], argv)
