"""FP8 block-quantised weights on CPU: dequantise once on load vs keep e4m3 + block scales and dequantise per
matmul (tile by tile, as a GPU kernel would). Prints a table; the anchor is the same matmul on a bf16 weight.

    flock /tmp/openglm-bench.lock python benchmarks/bench_fp8.py [--size 2048] [--block 128] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
from machine import cpu_model, median_time  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

from openglm.model.fp8 import dequantize, quantize


def per_tile_matmul(x, q, scale, block, dtype):
    """x @ W^T with W dequantised one [block x in] row tile at a time (never held whole)."""
    out = x.new_empty(x.shape[0], q.shape[0])
    for r0 in range(0, q.shape[0], block[0]):
        r1 = min(r0 + block[0], q.shape[0])
        tile = dequantize(q[r0:r1], scale[r0 // block[0]: r0 // block[0] + 1], block).to(dtype)
        out[:, r0:r1] = x @ tile.t()
    return out




def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048, help="weight is SIZE x SIZE (default: 2048)")
    ap.add_argument("--block", type=int, default=128, help="FP8 block edge (default: 128)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block = (args.block, args.block)
    w = torch.randn(args.size, args.size) * 0.02
    q, scale = quantize(w, block)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        deq = dequantize(q, scale, block).to(dtype)
        load_s = median_time(lambda: dequantize(q, scale, block).to(dtype), repeats=3)
        for n in (8, 512):
            x = torch.randn(n, args.size).to(dtype)
            on_load = median_time(lambda: x @ deq.t())
            tiled = median_time(lambda: per_tile_matmul(x, q, scale, block, dtype))
            rows.append({"dtype": str(dtype).removeprefix("torch."), "rows": n, "dequant_on_load_ms": on_load * 1e3,
                         "per_tile_ms": tiled * 1e3, "slowdown": tiled / on_load,
                         "weight_mib_on_load": deq.numel() * deq.element_size() / 2**20,
                         "weight_mib_fp8": (q.numel() + scale.numel() * 4) / 2**20, "one_time_load_ms": load_s * 1e3})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"CPU: {cpu_model()}, {args.threads} thread(s); weight {args.size}x{args.size}, blocks {block[0]}x{block[1]}")
    print(f"{'dtype':<9}{'rows':>5}{'on-load ms':>12}{'per-tile ms':>13}{'slowdown':>10}{'MiB on-load':>13}"
          f"{'MiB fp8':>9}{'load once ms':>14}")
    for r in rows:
        print(f"{r['dtype']:<9}{r['rows']:>5}{r['dequant_on_load_ms']:>12.3f}{r['per_tile_ms']:>13.3f}"
              f"{r['slowdown']:>9.1f}x{r['weight_mib_on_load']:>13.1f}{r['weight_mib_fp8']:>9.1f}"
              f"{r['one_time_load_ms']:>14.1f}")


if __name__ == "__main__":
    main()
