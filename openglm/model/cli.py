"""CLI commands of openglm.model: `openglm info`, `openglm convert`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from openglm.util.dtypes import argparse_dtype


def register(subparsers):
    p = subparsers.add_parser("info", help="parameter counts and weight memory of a model preset or checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small",
                     help="preset name: tiny, small, glm-5 (also glm-5.1), glm-4.5, glm-4.5-air, glm-4.6, glm-4.7, "
                          "glm-4.7-flash, glm-5.3-flash, ...; published names such as zai-org/GLM-5.1-FP8 name their "
                          "shape "
                          "(default: small)")
    src.add_argument("--checkpoint", help="a Hugging Face checkpoint directory, or a run folder (its latest "
                                          "checkpoint); reads its config.json only")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field (JSON value), e.g. --set num_hidden_layers=4")
    p.add_argument("--json", action="store_true", help="print JSON (keys total_params, active_params, ...)")
    p.add_argument("--parallel", default=None, metavar="tp=N,ep=M",
                   help="also print the weights each rank holds under this layout (tp/ep: serving; dp/ep: FSDP2 "
                        "training with fp32 weights, gradients and AdamW state), in parameters and GiB; "
                        "default: none")
    p.set_defaults(func=cmd_info)

    c = subparsers.add_parser("convert", help="rewrite a checkpoint: change its dtype, FP8 block-quantise it, "
                                              "int4-quantise it, or dequantise a quantised one")
    c.add_argument("source", help="checkpoint directory to read (any format `openglm serve` loads), or a run folder "
                                  "(its latest checkpoint)")
    c.add_argument("dest", help="directory to write (replaced atomically if it exists); the source's tokenizer "
                                "files and chat template are copied beside the weights")
    c.add_argument("--dtype", type=argparse_dtype(), default=None, metavar="DTYPE",
                   help="dtype of the written weights: bf16, fp16 or fp32 (also bfloat16, float16, float32; default: "
                        "the source's; an FP8 source: its unquantised dtype)")
    c.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="folder whose tokenizer files and chat template to write beside the weights (default: the "
                        "source's)")
    c.add_argument("--fp8", action="store_true",
                   help="write FP8 e4m3 block-quantised weights with *.weight_scale_inv (default: off)")
    c.add_argument("--fp8-block", default="128,128", metavar="ROWS,COLS",
                   help="FP8 block size in weight elements (default: 128,128)")
    c.add_argument("--int4", action="store_true",
                   help="write int4 weights (uint8 codes, two a byte, with bf16 *.weight_scale per group; "
                        "docs/model.md), which the CPU kernels read in place (default: off)")
    c.add_argument("--int4-group", type=int, default=32, choices=[32, 64, 128],
                   help="int4 group size: input columns per scale (default: 32)")
    c.add_argument("--max-shard-size", type=int, default=2 << 30, metavar="BYTES",
                   help="largest shard in bytes (default: 2147483648)")
    c.set_defaults(func=cmd_convert)


def cmd_info(args) -> int:
    # torch: loaded when the command runs, `openglm --help` stays fast
    from openglm.model.checkpoint import read_config, resolve_checkpoint
    from openglm.model.config import ModelConfig
    from openglm.model.errors import ModelError
    from openglm.model.parallel import (
        ParallelLayout,
        format_memory_report,
        memory_report,
    )
    from openglm.model.params import format_report, parameter_report

    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.checkpoint:
            name, cfg = args.checkpoint, read_config(resolve_checkpoint(args.checkpoint)).replace(**overrides)
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


def cmd_convert(args) -> int:
    # torch: loaded when the command runs, `openglm --help` stays fast
    from openglm.model.checkpoint import load_model, resolve_checkpoint
    from openglm.model.config import export_warnings
    from openglm.model.errors import ModelError
    from openglm.model.fp8 import Fp8Config
    from openglm.model.int4 import Int4Config
    from openglm.model.save import TOKENIZER_FILE, save_pretrained, tokenizer_source

    if args.fp8 and args.int4:
        print("error: --fp8 and --int4 exclude each other: pick one quantisation", file=sys.stderr)
        return 1
    try:
        block = tuple(int(x) for x in args.fp8_block.split(","))
        if len(block) != 2 or min(block) <= 0:
            raise ValueError
    except ValueError:
        print(f"error: --fp8-block {args.fp8_block!r}: expected two positive integers ROWS,COLS", file=sys.stderr)
        return 1
    try:
        source = resolve_checkpoint(args.source)
        tokenizer = Path(args.tokenizer) if args.tokenizer else source if (source / TOKENIZER_FILE).is_file() else None
        tokenizer_source(tokenizer, Path(args.dest))  # a --tokenizer without tokenizer.json: refused before loading
        model = load_model(source, dtype=args.dtype)
        save_pretrained(model, args.dest, max_shard_size=args.max_shard_size,
                        quantization=Fp8Config(block) if args.fp8 else Int4Config(args.int4_group) if args.int4
                        else None, tokenizer=tokenizer)
    except (ModelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for warning in export_warnings(model.config):
        print(f"warning: vLLM/SGLang would not reproduce this model: {warning}", file=sys.stderr)
    if tokenizer is None:
        print(f"warning: {source} has no {TOKENIZER_FILE}, so {args.dest} has weights only: serve it with "
              "--tokenizer PATH, or convert again with --tokenizer PATH", file=sys.stderr)
    kind = (f"FP8 e4m3 blocks {block[0]}x{block[1]}, other weights " if args.fp8 else
            f"int4 groups of {args.int4_group}, other weights " if args.int4 else "")
    print(f"wrote {args.dest} ({model.config.model_type}, {kind}{str(model.dtype).removeprefix('torch.')})")
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
