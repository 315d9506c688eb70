"""One attention layer (batch 1, 8 heads x 64 dims, fp32, causal) at long sequence lengths.

Kinds: materialised (scores in memory: the write-up's "conventional attention"), fused SDPA (causal),
DSA-gather (top-2048; lightning indexer 4 heads x 32 dims, GLM-5's ratio to the attention: 32 index heads x
128 dims for 64 heads of qk_head_dim 256; the opt-in bf16 fast path: indexer matmul in bf16 as a stand-in
for the real indexer's FP8, and the weighted sum of the selected values in bf16; the q.k scores and the
softmax stay fp32), local+global+random (512 / every 64th / 64 random),
sliding window 4096. DSA-gather uses its native (C) kernels where a C compiler is available; its note says
which path ran (`OPENGLM_DSA_NATIVE=0` forces the torch-op path). Each case runs in its own subprocess and
reports its wall time and the process's peak RSS (ru_maxrss); "attn MiB" is that peak minus the RSS after the
inputs were built. Materialised attention is only run where its score matrix is small; elsewhere its analytic
size (H x N x N x 4 bytes) is reported instead.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_attention.py [--json] [--lengths 4096,8192]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

H, D = 8, 64
INDEX_HEADS, INDEX_DIM, TOPK = 4, 32, 2048
KINDS = ("materialised", "sdpa", "dsa_gather", "local_global_random", "sliding_window")
MATERIALISED_MAX_BYTES = 2 << 30  # the machine is shared: never build a score matrix bigger than this
MiB = 1 << 20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MiB


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def materialised_bytes(n: int) -> int:
    return H * n * n * 4


def run_case(kind: str, n: int, threads: int) -> dict:
    """Runs inside the subprocess: build inputs, time the kernel once, report memory."""
    import torch
    torch.set_num_threads(threads)
    from openglm.model.glm5.sparse_dsa import dsa_attention
    from openglm.model.sparse import attention
    from openglm.model.sparse_patterns import SparsePattern
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))
    if kind == "dsa_gather":
        iq = torch.randn(1, n, INDEX_HEADS, INDEX_DIM, generator=g)
        ik = torch.randn(1, n, INDEX_DIM, generator=g)
        w = torch.rand(1, n, INDEX_HEADS, generator=g) * INDEX_HEADS ** -0.5
    base = rss_mib()
    t0 = time.perf_counter()
    if kind == "materialised":
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(D ** -0.5)
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
        torch.softmax(s, -1, out=s)
        out = torch.matmul(s, v)
    elif kind == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif kind == "dsa_gather":  # indexer + gather, fused per query block
        out = dsa_attention(q, k, v, iq, ik, w, TOPK, score_dtype=torch.bfloat16)
    elif kind == "local_global_random":
        out = attention(q, k, v, SparsePattern.lgr())
    elif kind == "sliding_window":
        out = attention(q, k, v, SparsePattern.sliding(4096))
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    ms = (time.perf_counter() - t0) * 1e3
    assert torch.isfinite(out).all(), f"{kind} at {n}: non-finite output"
    row = dict(kind=kind, n=n, ms=round(ms, 1), peak_mib=round(peak_mib(), 1),
               attn_mib=round(peak_mib() - base, 1), measured=True)
    if kind == "dsa_gather":  # which implementation ran (OPENGLM_DSA_NATIVE=0 or no C compiler: torch ops)
        from openglm.model.native import dsa_kernels
        row["note"] = "native kernels" if dsa_kernels() is not None else "torch ops"
    return row


def measure(kind: str, n: int, threads: int, timeout: float) -> dict:
    if kind == "materialised" and materialised_bytes(n) > MATERIALISED_MAX_BYTES:
        return dict(kind=kind, n=n, ms=None, measured=False, attn_mib=materialised_bytes(n) / MiB,
                    note="analytic: scores alone; not run on this shared 24 GiB machine")
    cmd = [sys.executable, __file__, "--case", kind, "--n", str(n), "--threads", str(threads)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(kind=kind, n=n, ms=None, measured=False, note=f"timed out after {timeout:.0f} s")
    if res.returncode != 0:
        return dict(kind=kind, n=n, ms=None, measured=False, note=f"failed: {res.stderr.strip()[-200:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def add_ratios(rows: list[dict]) -> None:
    by = {(r["kind"], r["n"]): r for r in rows}
    for r in rows:
        mat, sdpa = by.get(("materialised", r["n"])), by.get(("sdpa", r["n"]))
        if r.get("attn_mib") is not None and mat and mat.get("attn_mib"):
            r["mem_vs_materialised"] = round(r["attn_mib"] / mat["attn_mib"], 4)
        if r.get("peak_mib") and sdpa and sdpa.get("peak_mib"):
            r["peak_vs_sdpa"] = round(r["peak_mib"] / sdpa["peak_mib"], 2)
        if r.get("ms") and sdpa and sdpa.get("ms"):
            r["speedup_vs_sdpa"] = round(sdpa["ms"] / r["ms"], 2)
    for kind in KINDS:
        a, b = by.get((kind, 32768)), by.get((kind, 65536))
        if a and b and a.get("ms") and b.get("ms"):
            b["growth_32k_to_64k"] = round(b["ms"] / a["ms"], 2)


def fmt(x, spec="{:.1f}"):
    return "-" if x is None else spec.format(x)


def print_table(rows: list[dict]) -> None:
    head = f"{'kind':<20} {'N':>6} {'ms':>10} {'peak MiB':>9} {'attn MiB':>10} {'mem/mat':>8} {'peak/sdpa':>9} " \
           f"{'speed/sdpa':>10} {'32K->64K':>8}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        mat = r.get("mem_vs_materialised")
        print(f"{r['kind']:<20} {r['n']:>6} {fmt(r.get('ms')):>10} {fmt(r.get('peak_mib')):>9} "
              f"{fmt(r.get('attn_mib')):>10} {fmt(mat, '{:.2%}'):>8} {fmt(r.get('peak_vs_sdpa'), '{:.2f}x'):>9} "
              f"{fmt(r.get('speedup_vs_sdpa'), '{:.2f}x'):>10} {fmt(r.get('growth_32k_to_64k'), '{:.2f}x'):>8}  "
              f"{r.get('note', '') or ('indexer ' + str(r['indexer_ms']) + ' ms' if 'indexer_ms' in r else '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--long", default="131072", help="extra lengths run only for --long-kinds")
    ap.add_argument("--long-kinds", default="local_global_random,sliding_window")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per case (1: steady on a busy machine)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", help="also write the rows as JSON to this file (the table still prints)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.n, args.threads)))
        return
    plan = [(k, int(n)) for n in args.lengths.split(",") for k in args.kinds.split(",")]
    plan += [(k, int(n)) for n in args.long.split(",") if n for k in args.long_kinds.split(",")]
    from tqdm import tqdm
    rows = []
    for kind, n in (bar := tqdm(plan, file=sys.stderr)):
        bar.set_description(f"{kind} {n}")
        rows.append(measure(kind, n, args.threads, args.timeout))
    add_ratios(rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1) if args.json else "")
    if not args.json:
        print_table(rows)


if __name__ == "__main__":
    main()
