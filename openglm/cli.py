"""The single command-line entry point: `openglm <command> ...` (also `python -m openglm`).

Each area of the package registers its own subcommands through a `register(subparsers)`
function in its `cli` module; the heavy imports happen inside the command handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from openglm import __version__

# One module per area; each defines register(subparsers) and sets `func` on its parsers.
COMMAND_MODULES = [
    "openglm.model.cli",  # info
    "openglm.train.cli",  # train, generate, demo
    "openglm.server.cli",  # serve
    "openglm.server.deploy_cli",  # deploy
    "openglm.agent.cli",  # task, agent-server, worker
    "openglm.swe.cli",  # localize, verify, bisect, swe-eval, swe-gen
    "openglm.retrieval.cli",  # index
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openglm",
        description="openglm: the GLM-5.1 stack (model, training, serving, agent, retrieval) in Python.",
    )
    parser.add_argument("--version", action="version", version=f"openglm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
