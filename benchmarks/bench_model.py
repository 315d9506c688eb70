"""The model against this CPU's limits (and transformers' GlmMoeDsaForCausalLM, same weights), one run.

Presets: `small` (the CPU demo scale) and `medium` (GLM-5's head dimensions, 64 routed experts top-8, ~1.35B
total / ~0.38B active parameters). Per weight kind (fp32, bf16, and int8 / int4: bf16 activations over weights
quantised as `--quantization int8|int4` does, read in place by the kernels), measured in the same run:
- the limits: a dense matmul's FLOP/s (the MFU denominator) and a streaming read's bytes/s (memory bandwidth);
- prefill (one forward over batch x length random tokens): tokens/s and MFU;
- decode (one token per step on a cache holding a prompt; batch 1 and, for small, 8): tokens/s, MFU, and the
  achieved bandwidth: bytes of weights (as stored: int4 codes and scales for int4) and KV cache a step reads
  (`step_bytes`) / step time, against the streaming read;
- the MoE layer's GFLOP/s against a dense SwiGLU MLP with the same active FLOPs (prefill's token count), fp32 and
  bf16, with the expert path this CPU takes (`model/isa.py`: oneDNN's packed matmuls with AMX, else grouped);
- which kernels each path ran: the top ops of a profiled forward and the oneDNN primitives it executed.
Speed-ups against transformers are medians of interleaved runs (a, b, a, b, ...), so both see the same load.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_model.py [--preset small|medium] [--quick]
        [--dtypes float32,bfloat16,int8,int4] [--phases prefill,decode] [--threads 1] [--no-transformers] [--json]

`--preset medium --no-transformers` is the usual medium run (transformers' per-expert loop at that size takes
minutes per cell; ~11 GB for both fp32 copies).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from machine import cpu_model, isa, matmul_peak, median_time, memory_bandwidth  # benchmarks/ is on sys.path

from openglm.engine.quant import quantize_model
from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.glm5.decode_step import DecodePlan
from openglm.model.isa import experts_path
from openglm.model.moe import MLP, MoE
from openglm.model.native import decode_paths, dsa_kernels
from openglm.model.params import parameter_report
from openglm.model.quantized import QuantizedWeight

KINDS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}


@dataclass(frozen=True)
class Shapes:
    prefill_batch: int
    prefill_len: int
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_steps: int


SHAPES = {"small": Shapes(4, 512, (1, 8), 256, 32), "medium": Shapes(1, 512, (1,), 256, 16)}


def flops_per_token(cfg: ModelConfig, context: float) -> float:
    """Forward FLOPs of one token: 2 x active matmul params (no embedding lookup) + attention
    over min(index_topk, context) keys in the absorbed latent form."""
    r = parameter_report(cfg)
    matmul = r["active_params"] - r["breakdown"]["embeddings"] - r["breakdown"]["norms"]
    keys = min(cfg.index_topk, context)
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * keys * 2 * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2 * matmul + attn


def stored_bytes(t: torch.Tensor) -> int:
    return t.nbytes_stored() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()


def step_bytes(model, cfg: ModelConfig, batch: int, context: float, kv_elem: int) -> float:
    """Bytes one decode step of `batch` sequences must read: every weight (as stored: int8 / int4 values and their
    scales) but the routed experts, the embedding table (one row per token) and the next-n layers, the routed
    experts the batch hits (for top-k of E uniformly routed tokens, E(1 - (1 - k/E)^batch) per layer; exact at batch
    1), and each sequence's cache: the latent KV the attention reads (at most index_topk positions) and the indexer
    keys it scans (all positions)."""
    dense = routed = 0
    weights = dict(model.named_parameters())
    weights.update((n, b) for n, b in model.named_buffers() if isinstance(b, QuantizedWeight))
    for name, t in weights.items():
        if "embed_tokens" in name or "mtp_layers" in name:
            continue
        if ".mlp.experts." in name:
            routed += stored_bytes(t)
        else:
            dense += stored_bytes(t)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    experts = routed * (1 - (1 - k / E) ** batch)
    indexer_layers = sum(t == "full" for t in cfg.indexer_types)
    kv = (cfg.num_hidden_layers * min(cfg.index_topk, context) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
          + indexer_layers * context * cfg.index_head_dim)
    return dense + experts + batch * kv * kv_elem


def random_model(cfg: ModelConfig, kind: str) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():  # trained-like spread of weights so routing/top-k are not degenerate
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model = model.to(KINDS[kind])
    if kind in ("int8", "int4"):
        quantize_model(model, kind)
    return model


def hf_copy(cfg: ModelConfig, ours: GlmMoeDsaForCausalLM, dtype):
    from transformers import GlmMoeDsaConfig  # the test-time reference: only this script needs it
    from transformers import GlmMoeDsaForCausalLM as HFModel

    d = cfg.to_hf_dict()
    for k in ("openglm", "model_type", "architectures"):
        d.pop(k)
    hf = HFModel(GlmMoeDsaConfig(**d)).eval().to(dtype)
    # transformers' model has no next-n (MTP) layers; a plain forward of ours does not run them either
    hf.load_state_dict({k: v for k, v in ours.state_dict().items() if ".mtp_layers." not in k})
    return hf


def prefill_runner(m, ids, hf: bool):
    def run():
        t0 = time.perf_counter()
        m(input_ids=ids, use_cache=False) if hf else m(ids)
        return time.perf_counter() - t0
    return run


def decode_runner(m, prompt, steps: int, hf: bool):
    def run():  # times the decode steps only, not the prompt
        if hf:
            from transformers import DynamicCache as HFCache  # the reference's own cache class

            cache = HFCache(config=m.config)
            call = lambda ids: m(input_ids=ids, past_key_values=cache, use_cache=True)  # noqa: E731
        else:
            cache = DynamicCache()
            call = lambda ids: m(ids, cache=cache)  # noqa: E731
        call(prompt)
        tok = prompt[:, -1:]
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = call(tok).logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0
    return run


def medians(runners: list, repeats: int) -> list[float]:
    """Median seconds of each runner, interleaved (a, b, a, b, ...) after one warm-up each."""
    for run in runners:
        run()
    times = [[] for _ in runners]
    for _ in range(repeats):
        for t, run in zip(times, runners):
            t.append(run())
    return [statistics.median(t) for t in times]


def moe_vs_dense(cfg: ModelConfig, shapes: Shapes, dtype, repeats: int) -> tuple[float, float]:
    torch.manual_seed(0)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    active_inter = cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    dense = MLP(cfg, active_inter).to(dtype)
    x = torch.randn(shapes.prefill_batch, shapes.prefill_len, cfg.hidden_size, dtype=dtype)
    flops = x.numel() // cfg.hidden_size * 2 * 3 * cfg.hidden_size * active_inter
    with torch.inference_mode():
        t_moe = median_time(lambda: moe(x), repeats)
        t_dense = median_time(lambda: dense(x), repeats)
    return flops / t_moe, flops / t_dense


def _stdout_of(fn) -> str:
    """What `fn` writes to file descriptor 1 (oneDNN's verbose log is printed by C code, not Python)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def kernels_used(fn, top: int = 4) -> str:
    """The ops that took most of `fn`'s time (profiler self time; the native C kernels are called through
    ctypes and show as the Python time between ops) and the oneDNN primitive implementations it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e4 / wall:.0f}%" for e in events[:top])
    log = _stdout_of(lambda: _with_onednn_verbose(fn))
    prims = collections.Counter(",".join(line.split(",")[5:7]) for line in log.splitlines()
                                if line.startswith("onednn_verbose") and ",exec," in line)
    onednn = "; ".join(f"{k} x{n}" for k, n in prims.most_common(3)) or "none (MKL / ATen kernels)"
    return f"top ops: {ops} | oneDNN: {onednn}"


def decode_kernels_used(model, prompt) -> str:
    """`kernels_used` of two decode steps (the prompt's prefill runs before, unprofiled), and whether the steps
    ran the native decode layers (`model/decode_step.py`) or the torch ops."""
    cache = DynamicCache()
    model(prompt, cache=cache)
    tok = prompt[:, -1:]
    native = DecodePlan.create(model.model.layers, cache, tok, None, model.dtype) is not None
    path = f"decode_step: {'native, 3 C calls per layer' if native else 'torch ops'}"
    return f"{path} | {kernels_used(lambda: [model(tok, cache=cache) for _ in range(2)])}"


def _with_onednn_verbose(fn) -> None:
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()


def measure(cfg: ModelConfig, shapes: Shapes, kind: str, args, limits: dict) -> tuple[list, list]:
    dtype = KINDS[kind]
    ours = random_model(cfg, kind)
    hf = hf_copy(cfg, ours, dtype) if args.transformers and kind == str(dtype).removeprefix("torch.") else None
    name, elem = kind, torch.finfo(dtype).bits // 8
    torch.manual_seed(1)
    rows, kernels = [], []
    with torch.inference_mode():
        if "prefill" in args.phases:
            ids = torch.randint(3, cfg.vocab_size, (shapes.prefill_batch, shapes.prefill_len))
            models = [ours] + ([hf] if hf is not None else [])
            times = medians([prefill_runner(m, ids, m is hf) for m in models], args.repeats)
            rows.append(row("prefill", name, ids.numel(), shapes.prefill_len / 2, times, cfg, limits, None))
            kernels.append(("prefill", name, kernels_used(lambda: ours(ids))))
        for batch in shapes.decode_batches if "decode" in args.phases else ():
            prompt = torch.randint(3, cfg.vocab_size, (batch, shapes.decode_prompt))
            models = [ours] + ([hf] if hf is not None else [])
            times = medians([decode_runner(m, prompt, shapes.decode_steps, m is hf) for m in models], args.repeats)
            ctx = shapes.decode_prompt + shapes.decode_steps / 2
            moved = step_bytes(ours, cfg, batch, ctx, elem) * shapes.decode_steps
            rows.append(row(f"decode b{batch}", name, batch * shapes.decode_steps, ctx, times, cfg, limits, moved))
            if batch == shapes.decode_batches[0]:
                kernels.append((f"decode b{batch}", name, decode_kernels_used(ours, prompt)))
    return rows, kernels


def row(phase, dtype, tokens, ctx, times, cfg, limits, moved) -> dict:
    t_ours = times[0]
    fpt = flops_per_token(cfg, ctx)
    r = dict(phase=phase, dtype=dtype, openglm_tok_s=tokens / t_ours,
             openglm_mfu=fpt * tokens / t_ours / limits[f"peak_{str(KINDS[dtype]).removeprefix('torch.')}"])
    if len(times) > 1:
        r.update(transformers_tok_s=tokens / times[1], speedup=times[1] / t_ours)
    if moved is not None:
        r.update(achieved_gb_s=moved / t_ours / 1e9, bandwidth_share=moved / t_ours / limits["bandwidth"])
    return r


def print_tables(cfg_name, cfg, shapes, limits, rows, kernels, moe_rows) -> None:
    r = parameter_report(cfg)
    print(f"CPU: {cpu_model()} ({isa()}); {torch.get_num_threads()} thread(s)")
    print(f"native kernels: DSA {'built' if dsa_kernels() else 'off'}, decode {decode_paths()}")
    print(f"limits (same run): streaming read {limits['bandwidth'] / 1e9:.1f} GB/s; matmul peak "
          + ", ".join(f"{k.removeprefix('peak_')} {v / 1e9:.0f} GFLOP/s"
                      for k, v in limits.items() if k != "bandwidth"))
    print(f"{cfg_name} preset: {r['total_params'] / 1e6:,.1f}M params ({r['active_params'] / 1e6:,.1f}M active); "
          f"prefill {shapes.prefill_batch}x{shapes.prefill_len}; decode {shapes.decode_steps} steps after a "
          f"{shapes.decode_prompt}-token prompt\n")
    print(f"{'phase':<11}{'dtype':<10}{'openglm tok/s':>14}{'MFU':>7}{'GB/s':>7}{'of bw':>7}"
          f"{'transformers tok/s':>20}{'speed-up':>10}")
    for x in rows:
        bw = (f"{x['achieved_gb_s']:>7.1f}{100 * x['bandwidth_share']:>6.0f}%" if "achieved_gb_s" in x else " " * 14)
        hf = f"{x['transformers_tok_s']:>20,.1f}{x['speedup']:>9.2f}x" if "speedup" in x else ""
        print(f"{x['phase']:<11}{x['dtype']:<10}{x['openglm_tok_s']:>14,.1f}{100 * x['openglm_mfu']:>6.1f}%{bw}{hf}")
    if moe_rows:
        print(f"\nMoE layer ({shapes.prefill_batch * shapes.prefill_len} tokens) vs a dense SwiGLU MLP of the same "
              f"active FLOPs; bf16 experts path: {experts_path()}")
        print(f"{'dtype':<10}{'MoE GFLOP/s':>13}{'dense GFLOP/s':>15}{'ratio':>8}")
        for x in moe_rows:
            print(f"{x['dtype']:<10}{x['moe_gflops']:>13,.1f}{x['dense_gflops']:>15,.1f}{x['ratio']:>8.2f}")
    print("\nkernels (one profiled forward each)")
    for phase, dtype, text in kernels:
        print(f"  {phase:<10} {dtype:<9} {text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=sorted(SHAPES), help="model preset (default small)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables (default off)")
    ap.add_argument("--quick", action="store_true", help="3 timed repeats per cell instead of 5 (default off)")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4",
                    help="weight kinds, comma-separated: float32, bfloat16, int8, int4 (int8 / int4: bf16 "
                         "activations) (default float32,bfloat16,int8,int4)")
    ap.add_argument("--phases", default="prefill,decode", help="prefill and/or decode (default prefill,decode)")
    ap.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                    help="also time transformers' model on the same weights (default on)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on the shared 2-core machine a second thread contends with "
                         "other jobs and the figures swing by several x)")
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    args.phases = args.phases.split(",")
    if not args.phases or set(args.phases) - {"prefill", "decode"}:
        ap.error(f"--phases takes prefill and/or decode, got {','.join(args.phases)!r}")
    dtypes = args.dtypes.split(",")
    if not dtypes or set(dtypes) - set(KINDS):
        ap.error(f"--dtypes takes {', '.join(KINDS)}, got {args.dtypes!r}")
    torch.set_num_threads(args.threads)
    args.repeats = 3 if args.quick else 5
    cfg, shapes = ModelConfig.from_preset(args.preset), SHAPES[args.preset]
    limits = {"bandwidth": memory_bandwidth()}
    limits.update({f"peak_{str(d).removeprefix('torch.')}": matmul_peak(d) for d in dict.fromkeys(KINDS[k]
                                                                                                    for k in dtypes)})
    rows, kernels, moe_rows = [], [], []
    for kind in dtypes:
        r, k = measure(cfg, shapes, kind, args, limits)
        rows += r
        kernels += k
        if "prefill" in args.phases and kind in ("float32", "bfloat16"):
            moe, dense = moe_vs_dense(cfg, shapes, KINDS[kind], args.repeats)
            moe_rows.append(dict(dtype=kind, moe_gflops=moe / 1e9, dense_gflops=dense / 1e9, ratio=moe / dense))
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "isa": isa(), "preset": args.preset, "shapes": asdict(shapes),
                          "threads": torch.get_num_threads(), "limits": limits,
                          "params": parameter_report(cfg)["total_params"], "model": rows, "moe_layer": moe_rows,
                          "kernels": [dict(phase=p, dtype=d, kernels=k) for p, d, k in kernels]}, indent=2))
    else:
        print_tables(args.preset, cfg, shapes, limits, rows, kernels, moe_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
