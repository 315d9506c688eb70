"""openglm vs transformers GlmMoeDsaForCausalLM on the `small` preset, one run, same weights.

Cells: prefill (batch 4 x 512 tokens, one forward) and decode (batch 8, one token per step on a
cache holding a 256-token prompt), in fp32 and bf16; tokens/s (median of repeats), the speed-up,
and model-FLOPs utilisation against this CPU's measured dense-matmul peak. Also the MoE layer's
achieved GFLOP/s against a dense SwiGLU MLP with the same active FLOPs.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_model.py [--json] [--quick] [--threads N]
        [--phases prefill,decode] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from machine import median_time  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.moe import MLP, MoE
from openglm.model.params import parameter_report

PREFILL_B, PREFILL_T = 4, 512
DECODE_B, DECODE_PROMPT, DECODE_STEPS = 8, 256, 32




def matmul_peak(dtype, n=2048, repeats=5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats, warmup=2)


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Forward FLOPs of one token: 2 x active matmul params (no embedding lookup) + attention
    over min(index_topk, context) keys in the absorbed latent form."""
    r = parameter_report(cfg)
    matmul = r["active_params"] - r["breakdown"]["embeddings"] - r["breakdown"]["norms"]
    keys = min(cfg.index_topk, context)
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * keys * 2 * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2 * matmul + attn


def build(cfg: ModelConfig, dtype):
    from transformers import GlmMoeDsaConfig
    from transformers import GlmMoeDsaForCausalLM as HFModel

    torch.manual_seed(0)
    ours = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():  # trained-like spread of weights so routing/top-k are not degenerate
        for p in ours.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    d = cfg.to_hf_dict()
    for k in ("openglm", "model_type", "architectures"):
        d.pop(k)
    hf = HFModel(GlmMoeDsaConfig(**d)).eval()
    hf.load_state_dict(ours.state_dict())
    return ours.to(dtype), hf.to(dtype)


def timed(fn):
    def run():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def prefill_ours(m, ids):
    return timed(lambda: m(ids))


def prefill_hf(m, ids):
    return timed(lambda: m(input_ids=ids, use_cache=False))


def decode_ours(m, prompt, steps):
    def run():  # times the decode steps only, not the prompt
        cache = DynamicCache()
        m(prompt, cache=cache)
        tok = prompt[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = m(tok, cache=cache).logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0
    return run


def decode_hf(m, prompt, steps):
    from transformers import DynamicCache as HFCache

    def run():
        cache = HFCache(config=m.config)
        m(input_ids=prompt, past_key_values=cache, use_cache=True)
        tok = prompt[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = m(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0
    return run


def paired(run_a, run_b, repeats):
    """Median seconds of two runners, interleaved (a, b, a, b, ...) so both see the same machine load."""
    run_a(), run_b()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(run_a())
        b.append(run_b())
    return statistics.median(a), statistics.median(b)


def moe_vs_dense(cfg: ModelConfig, dtype, repeats):
    torch.manual_seed(0)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    active_inter = cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    dense = MLP(cfg, active_inter).to(dtype)
    x = torch.randn(PREFILL_B, PREFILL_T, cfg.hidden_size, dtype=dtype)
    flops = PREFILL_B * PREFILL_T * 2 * 3 * cfg.hidden_size * active_inter
    with torch.inference_mode():
        t_moe = median_time(lambda: moe(x), repeats)
        t_dense = median_time(lambda: dense(x), repeats)
    return flops / t_moe, flops / t_dense


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (3 instead of 5)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--phases", default="prefill,decode")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both models (default 1: on the shared 2-core machine a second "
                         "thread contends with other jobs and the figures swing by several x)")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    phases = args.phases.split(",")
    if not phases or set(phases) - {"prefill", "decode"}:
        ap.error(f"--phases takes prefill and/or decode, got {args.phases!r}")
    repeats = 3 if args.quick else 5
    cfg = ModelConfig.from_preset("small")
    rows, moe_rows = [], []
    torch.manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (PREFILL_B, PREFILL_T))
    prompt = torch.randint(3, cfg.vocab_size, (DECODE_B, DECODE_PROMPT))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        peak = matmul_peak(dtype)
        ours, hf = build(cfg, dtype)
        cells = {}
        with torch.inference_mode():
            if "prefill" in phases:
                cells["prefill"] = (PREFILL_B * PREFILL_T, PREFILL_T / 2,
                                    *paired(prefill_ours(ours, ids), prefill_hf(hf, ids), repeats))
            if "decode" in phases:
                cells["decode"] = (DECODE_B * DECODE_STEPS, DECODE_PROMPT + DECODE_STEPS / 2,
                                   *paired(decode_ours(ours, prompt, DECODE_STEPS),
                                           decode_hf(hf, prompt, DECODE_STEPS), repeats))
        for phase, (tokens, ctx, t_ours, t_hf) in cells.items():
            fpt = flops_per_token(cfg, ctx)
            rows.append(dict(phase=phase, dtype=name, openglm_tok_s=tokens / t_ours, transformers_tok_s=tokens / t_hf,
                             speedup=t_hf / t_ours, openglm_mfu=fpt * tokens / t_ours / peak,
                             transformers_mfu=fpt * tokens / t_hf / peak, matmul_peak_gflops=peak / 1e9))
        if "prefill" not in phases:
            continue
        moe_gf, dense_gf = moe_vs_dense(cfg, dtype, repeats)
        moe_rows.append(dict(dtype=name, moe_gflops=moe_gf / 1e9, dense_same_flops_gflops=dense_gf / 1e9,
                             ratio=moe_gf / dense_gf, matmul_peak_gflops=peak / 1e9))
    if args.json:
        print(json.dumps({"config": "small", "params": parameter_report(cfg)["total_params"], "threads":
                          torch.get_num_threads(), "model": rows, "moe_layer": moe_rows}, indent=2))
        return 0
    print(f"small preset ({parameter_report(cfg)['total_params'] / 1e6:.1f}M params), {torch.get_num_threads()} "
          f"threads; prefill {PREFILL_B}x{PREFILL_T}, decode batch {DECODE_B} x {DECODE_STEPS} steps after a "
          f"{DECODE_PROMPT}-token prompt")
    print(f"{'phase':<8}{'dtype':<10}{'openglm tok/s':>15}{'transformers tok/s':>20}{'speed-up':>10}"
          f"{'MFU openglm':>13}{'MFU hf':>9}")
    for r in rows:
        print(f"{r['phase']:<8}{r['dtype']:<10}{r['openglm_tok_s']:>15,.0f}{r['transformers_tok_s']:>20,.0f}"
              f"{r['speedup']:>9.2f}x{100 * r['openglm_mfu']:>12.1f}%{100 * r['transformers_mfu']:>8.1f}%")
    if not moe_rows:
        return 0
    print(f"\nMoE layer ({PREFILL_B}x{PREFILL_T} tokens) vs a dense SwiGLU MLP of the same active FLOPs")
    print(f"{'dtype':<10}{'MoE GFLOP/s':>13}{'dense GFLOP/s':>15}{'ratio':>8}{'matmul peak':>13}")
    for r in moe_rows:
        print(f"{r['dtype']:<10}{r['moe_gflops']:>13,.1f}{r['dense_same_flops_gflops']:>15,.1f}{r['ratio']:>8.2f}"
              f"{r['matmul_peak_gflops']:>13,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
