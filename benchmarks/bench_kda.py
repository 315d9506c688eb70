"""Kimi Delta Attention (glm5_next's linear attention) on CPU: the chunked form (prefill, training) against the
token loop it equals, and the recurrent decode step, per layer. Anchor: transformers 5.23.0's reference chunked
function (its pure-torch fallback, a row loop inside each chunk) on the same inputs, and the same-run fp32 matmul
peak. Prints a table.

    flock /tmp/openglm-bench.lock python benchmarks/bench_kda.py [--heads 8] [--head-dim 128] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
from machine import cpu_model, isa, matmul_peak, median_time  # benchmarks/machine.py

from openglm.model.glm5_next.kda import kda_chunked, kda_recurrent, l2_normalize


def inputs(B, T, H, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, d, generator=g)) * d ** -0.5
    k = l2_normalize(torch.randn(B, T, H, d, generator=g))
    v = torch.randn(B, T, H, d, generator=g)
    gates = -5 * torch.sigmoid(torch.randn(B, T, H, d, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    return q, k, v, gates, beta, torch.zeros(B, H, d, d)


def state_flops(T, H, d) -> float:
    """The delta rule's own work, 4 d^2 multiply-adds per token and head (decay, read, write, output)."""
    return 2 * 4 * T * H * d * d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8, help="KDA heads (GLM-5.3-Flash: 64; default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head width d (state d x d; default 128)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    H, d = args.heads, args.head_dim
    rows = []
    with torch.no_grad():
        for T in (512, 2048):
            x = inputs(1, T, H, d)
            chunked = median_time(lambda: kda_chunked(*x), repeats=3)
            loop = median_time(lambda: kda_recurrent(*x), repeats=1, warmup=0)
            rows.append({"form": "chunked", "tokens": T, "ms": chunked * 1e3, "tokens_per_s": T / chunked,
                         "gflops": state_flops(T, H, d) / chunked / 1e9, "vs_token_loop": loop / chunked})
            rows.append({"form": "token loop", "tokens": T, "ms": loop * 1e3, "tokens_per_s": T / loop,
                         "gflops": state_flops(T, H, d) / loop / 1e9, "vs_token_loop": 1.0})
        try:
            from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention
        except ImportError:  # the parity reference is a test dependency
            chunk_kimi_delta_attention = None
        if chunk_kimi_delta_attention is not None:
            T = 512
            q, k, v, g, beta, S = inputs(1, T, H, d)
            ref = median_time(lambda: chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=S), repeats=1)
            loop = next(r["ms"] for r in rows if r["form"] == "token loop" and r["tokens"] == T) / 1e3
            rows.append({"form": "transformers chunked (reference)", "tokens": T, "ms": ref * 1e3,
                         "tokens_per_s": T / ref, "gflops": state_flops(T, H, d) / ref / 1e9,
                         "vs_token_loop": loop / ref})
        for B in (1, 8):
            q, k, v, g, beta, S = inputs(B, 1, H, d)
            S = torch.randn(B, H, d, d)
            step = median_time(lambda: kda_recurrent(q, k, v, g, beta, S), repeats=21)
            rows.append({"form": f"decode step, batch {B}", "tokens": B, "ms": step * 1e3, "tokens_per_s": B / step,
                         "gflops": state_flops(B, H, d) / step / 1e9, "vs_token_loop": None})
    peak = matmul_peak(torch.float32) / 1e9
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "peak_fp32_gflops": peak, "rows": rows}, indent=2))
        return
    print(f"CPU: {cpu_model()} ({isa()}), {args.threads} thread(s); one KDA layer, {H} heads x d={d} "
          f"(state {d}x{d} fp32 per head); same-run fp32 matmul peak {peak:.1f} GFLOP/s")
    print(f"{'form':<34}{'tokens':>7}{'ms':>11}{'tokens/s':>11}{'GFLOP/s':>9}{'vs loop':>9}")
    for r in rows:
        vs = f"{r['vs_token_loop']:.1f}x" if r["vs_token_loop"] is not None else "-"
        print(f"{r['form']:<34}{r['tokens']:>7}{r['ms']:>11.2f}{r['tokens_per_s']:>11,.0f}{r['gflops']:>9.2f}{vs:>9}")
    print("GFLOP/s counts the delta rule's 4 d^2 multiply-adds per token and head (the chunked form does more).")


if __name__ == "__main__":
    main()
