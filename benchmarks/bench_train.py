"""Training throughput and MFU of the `small` preset: MoE vs a dense model with the same active parameters.

Both train on the stdlib corpus (same tokenizer, batch, sequence length, lr) for the same wall-clock
budget, each with a full warmup + cosine schedule fitted to that budget; the table reports tokens/s,
model-FLOPs utilisation against the bf16 (and fp32) matmul peak measured at the start of this run, and
the validation loss reached. Run under the benchmark lock:

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_train.py [--budget 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from machine import matmul_peak  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)


def active_matmul_params(model, cfg) -> int:
    """Parameters a token multiplies through (routed experts counted at top_k / n_experts; no embedding
    lookup; the DSA indexer is excluded: it runs without gradients, and not at all while T <= index_topk)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or ".indexer." in name or p.dim() < 2:
            continue
        n = p.numel()
        if ".experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n
    return total


def flops_per_token(model, cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul params + causal attention (QK^T and AV, fwd + bwd)."""
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * (seq_len / 2) * (cfg.qk_head_dim + cfg.v_head_dim)
    return 6 * active_matmul_params(model, cfg) + attn


def dense_twin(moe_cfg):
    """A dense config with the same active parameters: every layer a SwiGLU MLP whose width averages the
    MoE model's active widths (dense layers: intermediate_size; MoE layers: (shared + top_k) experts)."""
    n, n_moe = moe_cfg.num_hidden_layers, len(moe_cfg.moe_layers)
    moe_active = moe_cfg.moe_intermediate_size * (moe_cfg.n_shared_experts + moe_cfg.num_experts_per_tok)
    width = round(((n - n_moe) * moe_cfg.intermediate_size + n_moe * moe_active) / n)
    return moe_cfg.replace(intermediate_size=width, first_k_dense_replace=n, mlp_layer_types=["dense"] * n)


def run(args) -> list[dict]:
    from openglm.model import ModelConfig
    from openglm.train import dist
    from openglm.train.config import RECIPES, TrainConfig
    from openglm.train.demo import calibrate_steps
    from openglm.train.prepare import prepare_output, prepare_tokens
    from openglm.train.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    peak_bf16, peak_fp32 = matmul_peak(torch.bfloat16), matmul_peak(torch.float32)
    base = TrainConfig(**{**RECIPES["demo"], "out_dir": args.out, "progress": False, "plots": False,
                          "eval_windows": 64, "log_every": 10})
    out = prepare_output(args.out)
    tok, train_tokens, val_tokens = prepare_tokens(base, out, dist.DistInfo(), log=lambda m: print(m, file=sys.stderr))
    moe_cfg = ModelConfig.from_preset("small", vocab_size=tok.vocab_size)
    rows = []
    for name, mcfg in (("small MoE", moe_cfg), ("dense, same active", dense_twin(moe_cfg))):
        cfg = base.replace(out_dir=f"{args.out}/{name.split()[0].strip(',')}")
        trainer = Trainer(cfg, model_config=mcfg, tokenizer=tok, train_tokens=train_tokens, val_tokens=val_tokens)
        steps = calibrate_steps(trainer, args.budget, cap=100_000)
        cfg = cfg.replace(max_steps=steps, eval_every=steps, save_every=steps, time_budget_s=1.25 * args.budget,
                          warmup_steps=max(1, steps // 10))
        trainer.cfg = trainer.tracker.cfg = cfg
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = trainer.run()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        fpt = flops_per_token(trainer.model, mcfg, cfg.seq_len)
        tps = result.tokens_per_s
        rows.append({"model": name, "total_params_M": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
                     "active_params_M": active_matmul_params(trainer.model, mcfg) / 1e6, "steps": result.step,
                     "tokens_per_s": tps, "cpu_util": cpu / wall, "gflops_per_s": tps * fpt / 1e9,
                     "mfu_bf16": tps * fpt / peak_bf16, "mfu_fp32": tps * fpt / peak_fp32,
                     "val_loss": result.val_losses[result.step], "train_s": wall,
                     "peak_bf16_gflops": peak_bf16 / 1e9, "peak_fp32_gflops": peak_fp32 / 1e9})
        del trainer, result
    return rows


def print_table(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"matmul peak measured in this run: bf16 {r0['peak_bf16_gflops']:.0f} GFLOP/s, "
          f"fp32 {r0['peak_fp32_gflops']:.0f} GFLOP/s ({torch.get_num_threads()} threads)")
    head = ("model", "params M (active)", "steps", "tokens/s", "GFLOP/s", "MFU bf16", "MFU fp32", "val loss")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print(f"| {r['model']} | {r['total_params_M']:.1f} ({r['active_params_M']:.1f}) | {r['steps']} | "
              f"{r['tokens_per_s']:,.0f} | {r['gflops_per_s']:.1f} | {r['mfu_bf16']:.1%} | {r['mfu_fp32']:.1%} | "
              f"{r['val_loss']:.3f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=120.0, help="training seconds per model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/bench_train")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args()
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
