"""`openglm train`, `openglm generate`, `openglm demo` (heavy imports stay inside the handlers)."""

from __future__ import annotations

import argparse
import os
import sys

# flag -> TrainConfig field, for the options that map one to one
_TRAIN_FLAGS = {
    "preset": str, "data": str, "out": str, "tokenizer": str, "vocab_size": int, "seq_len": int, "batch_size": int,
    "grad_accum": int, "steps": int, "lr": float, "warmup_steps": int, "min_lr_ratio": float, "weight_decay": float,
    "grad_clip": float, "dtype": str, "activation_checkpointing": int, "device": str, "seed": int, "log_every": int,
    "eval_every": int, "eval_windows": int, "save_every": int, "keep_checkpoints": int, "time_budget": float,
    "collapse_share": float, "collapse_patience": int, "router_bias_rate": float, "threads": int,
    "mtp_loss_weight": float,
}
_FIELD = {"out": "out_dir", "steps": "max_steps", "time_budget": "time_budget_s"}
# flag -> what it sets (the default, from TrainConfig, is appended)
_TRAIN_HELP = {
    "preset": "model preset: tiny, small, glm-5", "data": "corpus: 'stdlib', a folder of text/code files, or "
    "a .jsonl with a \"text\" field", "out": "run folder (checkpoints, metrics.jsonl, plots)",
    "tokenizer": "folder with tokenizer.json (none: train a byte-level BPE on the corpus)",
    "vocab_size": "tokens of a tokenizer trained here (none: the preset's vocab_size)",
    "seq_len": "tokens per training sequence", "batch_size": "sequences per micro-batch, per process",
    "grad_accum": "micro-batches per optimizer step", "steps": "optimizer steps of the schedule",
    "lr": "peak learning rate", "warmup_steps": "linear warm-up, in optimizer steps",
    "min_lr_ratio": "cosine decay floor, as a fraction of --lr", "weight_decay": "AdamW weight decay",
    "grad_clip": "global gradient-norm clip (0: off)", "dtype": "autocast compute dtype: bf16 or fp32 (also bfloat16, "
    "float32)",
    "activation_checkpointing": "recompute activations in segments of k layers (0: off)",
    "device": "torch device: cpu, cuda, ...", "seed": "seed of init, data order and sampling",
    "log_every": "steps between metrics records", "eval_every": "steps between validations",
    "eval_windows": "validation sequences per evaluation", "save_every": "steps between checkpoints",
    "keep_checkpoints": "newest checkpoints kept (older ones pruned)",
    "time_budget": "stop with a checkpoint after this many seconds of training (none: no limit)",
    "collapse_share": "warn when one expert takes more than this fraction of a layer's tokens ...",
    "collapse_patience": "... for this many log intervals in a row",
    "router_bias_rate": "aux-loss-free balancing: per-step nudge of the routers' score bias",
    "threads": "torch CPU threads (none: all cores)",
    "mtp_loss_weight": "weight of the next-n (MTP) layer's cross-entropy on token t+2, "
                       "when the preset has one (0: off)",
}


def _default_of(flag: str):
    import dataclasses

    from openglm.train.config import TrainConfig  # a plain dataclass module: cheap to import here

    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == _FIELD.get(flag, flag))
    return field.default


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a GLM-style MoE on code (single process or torchrun)",
                              description="Train a model. Under `torchrun --nproc_per_node=N` it runs data-parallel.")
    p.add_argument("--recipe", choices=["demo"], help="start from a named recipe (then apply the flags)")
    for flag, typ in _TRAIN_FLAGS.items():
        default = _default_of(flag)
        p.add_argument("--" + flag.replace("_", "-"), type=typ, default=None, metavar=flag.upper(),
                       help=f"{_TRAIN_HELP[flag]} (default: {'none' if default is None else default}"
                            f"{', or the --recipe value' if flag != 'out' else ''})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field (JSON value), e.g. --set num_hidden_layers=4")
    p.add_argument("--parallel", default=None, metavar="dp=N,ep=M",
                   help="FSDP2 + expert-parallel layout under torchrun --nproc_per_node=N: dp = processes (dense "
                        "weights, gradients, AdamW sharded over them), ep = expert groups (each rank holds "
                        "n_routed_experts/ep experts; must divide dp). Default: none (plain data parallel)")
    p.add_argument("--offload-optimizer", action="store_true", help="keep AdamW state in CPU memory")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue exactly from the latest checkpoint in --out (or the given one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    p.add_argument("--no-plots", action="store_true", help="do not write loss.png / expert_load.png")
    p.set_defaults(func=_train)

    g = subparsers.add_parser("generate", help="complete a prompt with a trained checkpoint")
    g.add_argument("checkpoint", help="checkpoint folder, or a run folder (uses its latest checkpoint)")
    g.add_argument("--prompt", required=True, help="the text to complete")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy "
                                                                  "(default %(default)s)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all "
                                                         "(default %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling probability mass "
                                                             "(default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="folder with tokenizer.json, for a checkpoint saved without its tokenizer (default: the "
                        "checkpoint's own)")
    g.set_defaults(func=_generate)

    d = subparsers.add_parser("demo", help="the main job: train the small preset on the stdlib and show a sample")
    d.add_argument("--out", default="runs/demo", help="run folder (default %(default)s)")
    d.add_argument("--steps", type=int, default=None, help="optimizer steps (default: calibrated to --train-seconds)")
    d.add_argument("--train-seconds", "--budget-s", type=_seconds, default=os.environ.get("OPENGLM_DEMO_BUDGET_S"),
                   help="seconds of training to aim for; the step count is calibrated to it, 20 steps at least "
                        "(default: $OPENGLM_DEMO_BUDGET_S, else 240; CI uses a short budget)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    d.set_defaults(func=_demo)


def _seconds(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected seconds, e.g. 240, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


def _train_config(args):
    from openglm.model.cli import parse_override  # torch: loaded when the command runs, `openglm --help` stays fast
    from openglm.train.config import RECIPES, TrainConfig

    values = dict(RECIPES[args.recipe]) if args.recipe else {}
    for flag in _TRAIN_FLAGS:
        v = getattr(args, flag)
        if v is not None:
            values[_FIELD.get(flag, flag)] = v
    if args.parallel is not None:
        values["parallel"] = args.parallel
    overrides = {**values.get("model_overrides", {}), **dict(parse_override(item) for item in args.set)}
    values.update(model_overrides=overrides, offload_optimizer=args.offload_optimizer,
                  progress=not args.no_progress, plots=not args.no_plots)
    return TrainConfig(**values)


def _train(args) -> int:
    def run():
        from openglm.train.trainer import train  # torch: loaded when the command runs

        cfg = _train_config(args)
        result = train(cfg, resume=args.resume)
        last = result.val_losses.get(result.step)
        tail = f", validation loss {last:.3f}" if last is not None else ""
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            print(f"trained to step {result.step}{tail}; checkpoint {result.checkpoint}; metrics, plots: {cfg.out_dir}")

    return _guarded(run)


def _generate(args) -> int:
    def run():
        from openglm.model.checkpoint import load_model, resolve_checkpoint  # torch: loaded when the command runs
        from openglm.tokenizer import Tokenizer, tokenizer_folder
        from openglm.train.generate import generate

        ckpt = resolve_checkpoint(args.checkpoint)
        tok = Tokenizer.from_checkpoint(tokenizer_folder(ckpt, args.tokenizer))  # before the weights: fails fast
        model = load_model(ckpt)
        print(args.prompt, end="", flush=True)
        generate(model, tok, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 stream=lambda s: print(s, end="", flush=True))
        print()

    return _guarded(run)


def _demo(args) -> int:
    def run():
        from openglm.train.demo import TRAIN_SECONDS, run_demo  # torch: loaded when the command runs

        extra = {"threads": args.threads} if args.threads else {}
        run_demo(args.out, steps=args.steps, train_seconds=args.train_seconds or TRAIN_SECONDS,
                 progress=not args.no_progress, **extra)

    return _guarded(run)


def _guarded(fn) -> int:
    """Known input problems print one clear line instead of a traceback."""
    from openglm.model.errors import CheckpointError, ModelError
    from openglm.tokenizer import TokenizerError  # the error types live beside torch code: loaded when a command runs
    from openglm.train.data import CorpusError
    from openglm.train.prepare import TrainSetupError
    from openglm.train.trainer import TrainingDiverged

    known = (TokenizerError, CheckpointError, ModelError, CorpusError, TrainSetupError, TrainingDiverged, ValueError,
             FileNotFoundError)
    try:
        fn()
    except known as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

