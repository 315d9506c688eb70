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
    p.add_argument("--parallel", default=None, metavar="tp=N,ep=M",
                   help="also print the weights each rank holds under this layout (tp/ep: serving; dp/ep: FSDP2 "
                        "training with fp32 weights, gradients and AdamW state), in parameters and GiB; "
                        "default: none")
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from openglm.model.checkpoint import read_config  # torch: loaded when the command runs, `openglm --help` stays fast
    from openglm.model.config import ModelConfig
    from openglm.model.errors import ModelError
    from openglm.model.parallel import ParallelLayout, format_memory_report, memory_report
    from openglm.model.params import format_report, parameter_report

    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.checkpoint:
            name, cfg = args.checkpoint, read_config(args.checkpoint).replace(**overrides)
        else:
            name, cfg = args.preset, ModelConfig.from_preset(args.preset, **overrides)
        layout = ParallelLayout.parse(args.parallel) if args.parallel else None
        if layout is not None:
            _check_layout(layout, cfg)
    except (ModelError, ValueError, TypeError) as e:  # TypeError: replace() with an unknown field
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = parameter_report(cfg)
    memory = memory_report(cfg, layout) if layout is not None else None
    if args.json:
        print(json.dumps({"model": name, **report, **({"parallel": memory} if memory else {})}, indent=2))
    else:
        print(format_report(name, cfg, report))
        if memory:
            print(format_memory_report(memory))
    return 0


def _check_layout(layout, cfg) -> None:
    """The checks `openglm serve` / `openglm train` apply to this layout (without a process count)."""
    # deferred like the handler's imports: `openglm --help` imports this module
    from openglm.model.parallel import check_serving_layout, check_training_layout

    if layout.tp > 1 or layout.dp == 1:
        check_serving_layout(layout, cfg)
    if layout.tp == 1:
        check_training_layout(layout.__class__(dp=max(layout.dp, layout.ep), ep=layout.ep), cfg)


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
