"""FSDP2 + expert-parallel training on 1, 2 and 4 processes (gloo, CPU): tokens/s and memory per rank.

Each run is `torchrun --nproc_per_node=N` of this script's worker: the `small` preset (16 routed experts)
under layout dp=N,ep=N, random tokens, fp32, one thread per process. Per rank it reports the routed-expert
and dense parameters it holds (bytes of its local tensors: weights; AdamW adds 2x, gradients 1x) and its
peak RSS. The point is the expert share falling as 1/ep; on a 2-core machine 4 processes share 2 cores,
so the throughput cannot scale (the same-run 1-process figure is the anchor).

    python benchmarks/bench_parallel.py [--steps 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def worker(steps: int, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from openglm.train import TrainConfig, train

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    tokens = np.random.default_rng(0).integers(0, 8192, size=400_000)
    cfg = TrainConfig(out_dir=tempfile.mkdtemp(prefix="bench-parallel-"), preset="small", seq_len=128, batch_size=4,
                      max_steps=steps, warmup_steps=1, dtype="fp32", eval_every=10**6, save_every=10**6,
                      log_every=10**6, eval_windows=2, progress=False, plots=False, parallel=f"dp={world},ep={world}")
    result = train(cfg, train_tokens=tokens[:360_000], val_tokens=tokens[360_000:])
    experts = dense = 0
    for name, p in result.model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        if ".mlp.experts." in name:
            experts += nbytes
        else:
            dense += nbytes
    row = torch.tensor([experts, dense, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                        result.tokens_per_s], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([r.tolist() for r in rows]))
    dist.destroy_process_group()


def run(n: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--worker", str(out), "--steps", str(steps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{n} processes failed:\n{proc.stderr[-3000:]}")
        rows = json.loads(out.read_text())
    mib = 2**20
    return {"processes": n, "layout": f"dp={n},ep={n}", "tokens_per_s": rows[0][3],
            "expert_mib_per_rank": max(r[0] for r in rows) / mib, "dense_mib_per_rank": max(r[1] for r in rows) / mib,
            "peak_rss_mib_per_rank": max(r[2] for r in rows) / mib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.steps, args.worker)
    results = [run(n, args.steps) for n in (1, 2, 4)]
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "cores": os.cpu_count(), "results": results}, indent=2))
        return
    base = results[0]
    print(f"bench_parallel: small preset (16 routed experts), fp32, seq 128 x 4 per rank, {args.steps} steps, gloo")
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores; processes beyond the cores share them)")
    print(f"{'procs':>5} {'layout':>10} {'tokens/s':>9} {'vs 1':>5} {'experts MiB/rank':>17} {'x of 1':>7} "
          f"{'dense MiB/rank':>15} {'peak RSS MiB/rank':>18}")
    for r in results:
        print(f"{r['processes']:>5} {r['layout']:>10} {r['tokens_per_s']:>9,.0f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>5.2f} {r['expert_mib_per_rank']:>17.2f} "
              f"{r['expert_mib_per_rank'] / base['expert_mib_per_rank']:>7.3f} {r['dense_mib_per_rank']:>15.2f} "
              f"{r['peak_rss_mib_per_rank']:>18.0f}")


if __name__ == "__main__":
    main()
