"""Context-aware vs standard MoE routing on the 2-core CPU: the `small` preset trained with the demo's recipe (stdlib
corpus, 4096-token BPE, 16 x 128 tokens a step, bf16 autocast, MTP loss, aux-loss-free bias balancing), once with the
standard sigmoid router and once with `router_context="gated"` (openglm/model/context_router.py, its defaults), for
the same steps, seeds (init of every shared weight and data order) and wall-clock cap; the two routers alternate seed
by seed, so a noisy stretch of the shared machine falls on both.

Each run reports validation loss, routing accuracy (context and lexical categories from openglm/train/code_context.py),
NMI, balance (definitions in openglm/train/routing_eval.py), the share of held-out routes the context term decides
(top-k sets that change when it is switched off) and training tokens/s; the table gives mean +- sample std over seeds
and the context router's change paired by seed (absolute, and relative to the standard router's mean). Because
throughput on a shared machine is noisy, a training step of both models is also timed in turn before the runs. The
PNG shows expert x context-category load of the first seed, both routers, every MoE layer. Run under the lock:

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_routing.py [--steps 150] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model, isa  # noqa: E402 - benchmarks/ is not a package

ROUTERS = {"standard": {}, "context-aware": {"router_context": "gated"}}
COLUMNS = (  # (summary key, header, format)
    ("val_loss", "val loss", "{:.3f}"),
    ("acc_context", "routing acc, context (top-k sets)", "{:.1%}"),
    ("acc_lexical", "routing acc, lexical (top-k sets)", "{:.1%}"),
    ("top1_acc_context", "top-1 acc, context (layer mean)", "{:.1%}"),
    ("nmi_context", "NMI context (layer mean)", "{:.3f}"),
    ("context_decided", "routes set by context", "{:.1%}"),
    ("load_cv", "load CV", "{:.3f}"),
    ("dead_experts", "dead experts", "{:.1f}"),
    ("tokens_per_s", "train tok/s", "{:,.0f}"),
    ("train_s", "train s", "{:.0f}"),
)


def setup(args):
    """Tokenizer, token streams, and the labelled fit / held-out windows (all shared by every run)."""
    from openglm.train import dist
    from openglm.train.config import RECIPES, TrainConfig
    from openglm.train.data import load_documents, split_documents
    from openglm.train.prepare import prepare_output, prepare_tokens
    from openglm.train.routing_eval import labelled_windows

    base = TrainConfig(**{**RECIPES["demo"], "out_dir": args.out, "progress": False, "plots": False,
                          "max_steps": args.steps, "eval_every": args.steps, "save_every": args.steps,
                          "warmup_steps": max(1, args.steps // 10), "time_budget_s": args.cap,
                          "threads": args.threads})
    out = prepare_output(args.out)
    tok, train_tokens, val_tokens = prepare_tokens(base, out, dist.DistInfo(), log=_say)
    train_docs, val_docs = split_documents(load_documents(base.data), base.val_fraction)
    fit = labelled_windows(train_docs, tok, base.seq_len, args.eval_windows)
    held_out = labelled_windows(val_docs, tok, base.seq_len, args.eval_windows)
    _say(f"labelled windows: fit {fit.ids.size:,} tokens ({fit.documents} train documents), held-out "
         f"{held_out.ids.size:,} tokens ({held_out.documents} validation documents)")
    return base, tok, train_tokens, val_tokens, fit, held_out


def run_one(base, tok, train_tokens, val_tokens, fit, held_out, router: str, seed: int, out: Path) -> dict:
    from openglm.model import ModelConfig
    from openglm.train.routing_eval import capture_routing, context_decided, evaluate_routing
    from openglm.train.trainer import Trainer

    mcfg = ModelConfig.from_preset(base.preset, vocab_size=tok.vocab_size, **ROUTERS[router])
    cfg = base.replace(seed=seed, out_dir=str(out / f"{router}-seed{seed}"))
    trainer = Trainer(cfg, model_config=mcfg, tokenizer=tok, train_tokens=train_tokens, val_tokens=val_tokens)
    wall = time.perf_counter()
    result = trainer.run()
    train_s = time.perf_counter() - wall
    bf16 = cfg.dtype == "bf16"
    t0 = time.perf_counter()
    held_routes = capture_routing(trainer.model, held_out.ids, bf16=bf16)
    report = evaluate_routing(capture_routing(trainer.model, fit.ids, bf16=bf16), fit, held_routes, held_out,
                              mcfg.n_routed_experts)
    decided = context_decided(trainer.model, held_out.ids, held_routes, bf16=bf16) if mcfg.router_context != "none" \
        else 0.0
    row = {"router": router, "seed": seed, "steps": result.step, "val_loss": result.val_losses[result.step],
           "tokens_per_s": result.tokens_per_s, "train_s": train_s, "context_decided": decided, **report.summary(),
           "per_layer": {"top1_acc_context": report.top1_accuracy["context"], "nmi_context": report.nmi["context"],
                         "load_cv": report.load_cv, "dead_experts": report.dead_experts},
           "category_load": report.category_load.tolist()}
    _say(f"{router} seed {seed}: {result.step} steps in {train_s:.0f}s ({result.tokens_per_s:,.0f} tok/s), val loss "
         f"{row['val_loss']:.3f}, routing acc {row['acc_context']:.1%} context / {row['acc_lexical']:.1%} lexical, "
         f"NMI {row['nmi_context']:.3f}, load CV {row['load_cv']:.3f}; evaluation {time.perf_counter() - t0:.0f}s")
    return row


def step_cost(tok, repeats: int = 7) -> dict[str, float]:
    """The fastest of `repeats` bf16 forward + backward passes of a 16 x 128 batch per router (the least disturbed on a
    shared machine), the two models timed in turn, same init seed and batch."""
    import torch.nn.functional as F

    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig

    models = {}
    for name, overrides in ROUTERS.items():
        torch.manual_seed(0)
        models[name] = GlmMoeDsaForCausalLM(ModelConfig.from_preset("small", vocab_size=tok.vocab_size, **overrides))
    batch = torch.randint(3, tok.vocab_size, (16, 129), generator=torch.Generator().manual_seed(0))

    def step(model):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(batch[:, :-1], aux=True, mtp=True)
        logits = out.logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)) + out.aux.aux_loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times = {name: [] for name in models}
    for i in range(repeats + 1):
        for name, model in models.items():
            spent = step(model)
            if i:  # the first step of each model warms up
                times[name].append(spent)
    return {name: min(t) for name, t in times.items()}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(rows: list[dict], references: dict, costs: dict, args) -> str:
    by_router = {name: [r for r in rows if r["router"] == name] for name in ROUTERS}
    n = len(args.seeds)
    lines = [f"CPU: {cpu_model()} ({isa()}); torch threads {torch.get_num_threads()}",
             f"small preset, demo recipe, {args.steps} steps of 16 x 128 tokens, seeds {args.seeds} "
             f"(mean +- sample std over {n} seeds); held-out = validation-split documents",
             "| router | steps | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 2) + "|"]
    for name, runs in by_router.items():
        steps = "/".join(sorted({str(r["steps"]) for r in runs}))
        cells = []
        for key, _, fmt in COLUMNS:
            m, s = mean_std([r[key] for r in runs])
            cells.append(f"{fmt.format(m)} +- {fmt.format(s)}")
        lines.append(f"| {name} | {steps} | " + " | ".join(cells) + " |")
    std, ctx = by_router["standard"], by_router["context-aware"]
    cells = []
    for key, _, fmt in COLUMNS:
        by_seed = zip(sorted(std, key=lambda r: r["seed"]), sorted(ctx, key=lambda r: r["seed"]))
        diffs = [c[key] - s[key] for s, c in by_seed]
        m, s = mean_std(diffs)
        base = statistics.fmean(r[key] for r in std)
        rel = f" ({m / base:+.1%})" if base else ""
        if "%" in fmt:
            cells.append(f"{m * 100:+.1f} pt +- {s * 100:.1f}{rel}")
        else:
            cells.append(f"{'+' if m >= 0 else '-'}{fmt.format(abs(m))} +- {fmt.format(s)}{rel}")
    lines.append("| change (paired by seed) | | " + " | ".join(cells) + " |")
    ref = references
    std_cost, ctx_cost = costs["standard"], costs["context-aware"]
    lines.append("")
    lines.append(f"training step (bf16 forward + backward with the MTP layer, 16 x 128 tokens, fastest of 7, the two "
                 f"models in turn): standard {std_cost:.3f} s, context-aware {ctx_cost:.3f} s "
                 f"({ctx_cost / std_cost - 1:+.1%})")
    lines.append(f"references on the same held-out tokens: majority class {ref['context']['majority']:.1%} context / "
                 f"{ref['lexical']['majority']:.1%} lexical; token id alone {ref['context']['token id']:.1%} context "
                 f"/ {ref['lexical']['token id']:.1%} lexical")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (both routers)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--cap", type=float, default=600.0, help="wall-clock cap per run, seconds (equal for both)")
    p.add_argument("--eval-windows", type=int, default=384, help="labelled 128-token windows per side (fit, held-out)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/bench_routing")
    p.add_argument("--plot", default=None, help="PNG of expert x category load (default: <out>/category_load.png)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from openglm.train.code_context import CONTEXT
    from openglm.train.plots import plot_category_load
    from openglm.train.routing_eval import reference_accuracies

    base, tok, train_tokens, val_tokens, fit, held_out = setup(args)
    references = reference_accuracies(fit, held_out)
    costs = step_cost(tok)
    out, rows = Path(args.out), []
    for seed in args.seeds:
        for router in ROUTERS:
            rows.append(run_one(base, tok, train_tokens, val_tokens, fit, held_out, router, seed, out))
    (out / "results.json").write_text(json.dumps({"rows": rows, "references": references, "step_s": costs}, indent=1))
    first = {r["router"]: r for r in rows if r["seed"] == args.seeds[0]}
    import numpy as np

    png = plot_category_load({name: np.asarray(r["category_load"]) for name, r in first.items()}, list(CONTEXT),
                             args.plot or out / "category_load.png",
                             notes={name: f"seed {r['seed']}, NMI {r['nmi_context']:.3f}" for name, r in first.items()})
    print(table(rows, references, costs, args))
    print(f"\nplot: {png}; per-run figures: {out / 'results.json'}")
    return 0


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
