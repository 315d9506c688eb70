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
    "openglm.deploy.cli",  # serve, deploy
    "openglm.agent.cli",  # task, agent-server, worker
    "openglm.swe.cli",  # localize, verify, bisect, swe-eval, swe-gen
    "openglm.retrieval.cli",  # index
    "openglm.doctor.cli",  # doctor
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openglm",
        description="openglm: the GLM-5.1 stack (model, training, serving, agent, retrieval) in Python.",
    )
    parser.add_argument("--version", action="version", version=f"openglm {__version__}",
                        help="print the version and exit")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (default: one line naming what was wrong)")
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
    except Exception as e:  # noqa: BLE001 - only user errors are shortened; the rest re-raise
        if args.debug or not is_user_error(e):
            raise
        print(f"openglm {args.command}: error: {one_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return 1
    return int(result or 0)


# Error types of the areas that mean "bad input or environment", looked up only if their module was
# imported by the command that failed (so this module imports no area).
USER_ERROR_TYPES = [("openglm.client", "GLMClientError"), ("openglm.agent.store.base", "StoreError"),
                    ("openglm.agent.snapshot", "SnapshotError"), ("openglm.util.git", "GitError")]


def is_user_error(e: Exception) -> bool:
    """Bad input or environment (a missing file, a bad value, a server that is down, a refused state
    change, a git command that failed): worth one line. Anything else is a bug and keeps its traceback."""
    known = tuple(getattr(sys.modules.get(module), name, None) for module, name in USER_ERROR_TYPES)
    return isinstance(e, (OSError, ValueError, *(t for t in known if t is not None)))


def one_line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
