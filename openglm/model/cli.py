"""CLI commands of openglm.model: `openglm info`."""

from __future__ import annotations

import json
import sys


def register(subparsers):
    p = subparsers.add_parser("info", help="parameter counts and weight memory of a model preset or checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small", help="preset name: tiny, small, glm-5 (default: small)")
    src.add_argument("--checkpoint", help="a Hugging Face checkpoint directory (reads its config.json only)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field (JSON value), e.g. --set num_hidden_layers=4")
    p.add_argument("--json", action="store_true", help="print JSON (keys total_params, active_params, ...)")
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from openglm.model.checkpoint import read_config  # torch: loaded when the command runs, `openglm --help` stays fast
    from openglm.model.config import ModelConfig
    from openglm.model.errors import ModelError
    from openglm.model.params import format_report, parameter_report

    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.checkpoint:
            name, cfg = args.checkpoint, read_config(args.checkpoint).replace(**overrides)
        else:
            name, cfg = args.preset, ModelConfig.from_preset(args.preset, **overrides)
    except (ModelError, ValueError, TypeError) as e:  # TypeError: replace() with an unknown field
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = parameter_report(cfg)
    if args.json:
        print(json.dumps({"model": name, **report}, indent=2))
    else:
        print(format_report(name, cfg, report))
    return 0


def parse_override(text: str):
    """One `--set FIELD=VALUE` option (also `openglm train`'s) as (field, value): JSON if it parses, else the
    string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set {text!r}: expected FIELD=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value
