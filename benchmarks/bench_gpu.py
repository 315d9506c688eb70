"""The GPU path: openglm's Triton kernels against the model's PyTorch ops on the same CUDA device, and against
that device's roofline, at GLM-5's real widths; then the engine end to end on the medium preset.

    .venv/bin/python benchmarks/bench_gpu.py [--quick] [--skip-e2e] [--json PATH]

Needs a CUDA device and triton (`pip install 'openglm[gpu]'`, with a CUDA build of torch). Without a CUDA
device it prints one line saying so and exits with status 2 (the kernels' arithmetic is checked without one
by the interpreter tests, tests/kernels).

Layers (one layer of each: GLM-5's layers are alike), bf16 activations:
- moe: the routed experts of one MoE layer, hidden 6144, expert width 2048, 256 experts, top-8 (19.3 GB of
  bf16 weights): decode (32 tokens) and prefill (4,096 tokens), bf16 weights and FP8 e4m3 weights in 128 x 128
  blocks (the GLM FP8 checkpoints' layout). PyTorch ops: the model's `Experts` on the bf16 weights (its FP8
  loader dequantises to bf16 too).
- indexer: the lightning indexer's scores and top-2048 (32 heads x 128), decode (32 sequences x 32K cached
  keys, paged in blocks of 64) and prefill (4,096 queries over 32K keys); fp32 products (the model's default,
  exact) and bf16 products (its opt-in `score_dtype`). PyTorch ops: `sparse_dsa.indexer_topk`.
- attention: DSA over the selected latent rows, 64 heads, latent 512 + rope 64, top-2048; decode (32
  sequences, paged) and prefill (4,096 queries). PyTorch ops: `sparse_dsa.gather_attention`.

Each time is the median of triton.testing.do_bench (L2 flushed between runs). FLOPs and bytes are counted
from the shapes (bytes: what must cross HBM at least: weights of the experts hit, selected rows, activations);
"% roof" is the roofline time max(FLOPs / peak FLOP/s, bytes / peak B/s) over the measured time, with the
datasheet peaks of the device named in the header (bf16 dense tensor FLOP/s, HBM B/s) where this script knows
the device, else the peaks measured in the same run (a large bf16 matmul, a device-to-device copy).
A case that fails prints its error in its row; the others still run.

End to end (unless --skip-e2e): the `medium` preset (random weights, bf16) in LLMEngine on the device, 8 prompts
of 4,096 tokens (past index_topk = 2,048, so DSA selects) then 64 new tokens each: prefill tokens/s (until
every request has its first token) and decode tokens/s (the rest), with the kernels and with the PyTorch ops.
--quick shrinks every case (smaller batches and contexts) for a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402 - benchmarks/ is not a package

# Datasheet peaks: dense bf16 tensor-core FLOP/s (no sparsity) and HBM bytes/s, by a substring of the device name
# (more specific names first).
DATASHEET = [
    ("H200", "NVIDIA H200 (SXM)", 989e12, 4.8e12),
    ("H100 PCIe", "NVIDIA H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", "NVIDIA H100 NVL", 835e12, 3.9e12),
    ("H100", "NVIDIA H100 SXM", 989e12, 3.35e12),
    ("H800", "NVIDIA H800 SXM", 989e12, 3.35e12),
    ("B200", "NVIDIA B200", 2250e12, 8.0e12),
    ("A100-SXM4-80GB", "NVIDIA A100 SXM 80GB", 312e12, 2.039e12),
    ("A100", "NVIDIA A100 40GB", 312e12, 1.555e12),
    ("L40S", "NVIDIA L40S", 362e12, 0.864e12),
]
DEVICE = "cuda"
GLM5 = dict(hidden=6144, inter=2048, experts=256, top_k=8, heads=64, rank=512, rope=64, index_heads=32,
            index_dim=128, topk=2048)


def no_device_line() -> str:
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    return (f"bench_gpu: no CUDA device (torch {torch.__version__}, {build}): nothing to measure; the kernels' "
            "correctness is checked without one by tests/kernels (Triton's interpreter)")


class Device:
    """The device, its datasheet peaks where known, and the peaks measured in this run."""

    def __init__(self):
        import triton

        self.name = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        self.memory, self.sms = props.total_memory, props.multi_processor_count
        self.triton = triton.__version__
        known = next(((label, f, b) for key, label, f, b in DATASHEET if key in self.name), None)
        self.datasheet = known
        self.measured_flops, self.measured_bw = self._measure()
        self.peak_flops = known[1] if known else self.measured_flops
        self.peak_bw = known[2] if known else self.measured_bw

    @staticmethod
    def _measure() -> tuple[float, float]:
        from triton.testing import do_bench

        n = 8192
        a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        flops = 2 * n ** 3 / (do_bench(lambda: a @ b, return_mode="median") * 1e-3)
        src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        bw = 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)
        return flops, bw

    def header(self) -> list[str]:
        peak = (f"datasheet {self.datasheet[0]}: {self.datasheet[1] / 1e12:.0f} TFLOPS bf16 dense, "
                f"{self.datasheet[2] / 1e12:.2f} TB/s HBM" if self.datasheet else
                f"no datasheet entry for {self.name!r}: the roofline uses the measured peaks")
        return [f"device: {self.name}, {self.sms} SMs, {self.memory / 2**30:.0f} GiB; host CPU: {cpu_model()}",
                f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {self.triton}",
                f"roofline peaks: {peak}",
                f"measured this run: {self.measured_flops / 1e12:.0f} TFLOPS (8192^3 bf16 matmul), "
                f"{self.measured_bw / 1e12:.2f} TB/s (1 GiB device copy, read + write)"]


def median_ms(fn) -> float:
    """Median milliseconds of fn: triton.testing.do_bench (L2 flushed between runs) for what takes under a
    quarter second, else the median of 3 timed calls after one warm-up (a slow PyTorch baseline)."""
    from triton.testing import do_bench

    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    if time.perf_counter() - t0 < 0.25:
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def case_row(dev: Device, name: str, shape: str, flops: float, nbytes: float, kernel, pytorch) -> dict:
    row = {"case": name, "shape": shape, "flops": flops, "bytes": nbytes}
    try:
        with torch.inference_mode():
            row["kernel_ms"] = median_ms(kernel)
            row["pytorch_ms"] = median_ms(pytorch) if pytorch is not None else None
    except Exception as exc:  # noqa: BLE001 - one failing case must not cost the others' figures
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    torch.cuda.empty_cache()
    return row


def format_rows(dev: Device, rows: list[dict]) -> list[str]:
    head = (f"{'case':<26}{'shape':<40}{'kernel ms':>10}{'PyTorch ms':>11}{'speed-up':>9}{'TFLOPS':>8}"
            f"{'GB/s':>8}{'% roof':>8}")
    out = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['case']:<26}{r['shape']:<40}  failed: {r['error']}")
            continue
        t = r["kernel_ms"] * 1e-3
        roof = max(r["flops"] / dev.peak_flops, r["bytes"] / dev.peak_bw)
        torch_ms, kernel_ms = r["pytorch_ms"], r["kernel_ms"]
        baseline = f"{torch_ms:.3f}" if torch_ms else "-"
        speedup = f"{torch_ms / kernel_ms:.2f}x" if torch_ms else "-"
        out.append(f"{r['case']:<26}{r['shape']:<40}{kernel_ms:>10.3f}{baseline:>11}{speedup:>9}"
                   f"{r['flops'] / t / 1e12:>8.1f}{r['bytes'] / t / 1e9:>8.0f}{100 * roof / t:>7.0f}%")
    return out


# ---- the cases -------------------------------------------------------------------------------------------

def moe_rows(dev: Device, quick: bool) -> list[dict]:
    from torch import nn

    from openglm.kernels import moe as kernels
    from openglm.model import gpu
    from openglm.model.config import ModelConfig
    from openglm.model.fp8 import quantize
    from openglm.model.moe import Experts

    H, inter, E, k = GLM5["hidden"], GLM5["inter"], GLM5["experts"], GLM5["top_k"]
    E = 64 if quick else E
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = torch.randn(E, 2 * inter, H, device=DEVICE, dtype=torch.bfloat16, generator=g) * H ** -0.5
    down = torch.randn(E, H, inter, device=DEVICE, dtype=torch.bfloat16, generator=g) * inter ** -0.5
    cfg = ModelConfig.from_preset("tiny", hidden_size=H, moe_intermediate_size=inter, n_routed_experts=E,
                                  num_experts_per_tok=k, n_group=1, topk_group=1)
    with torch.device("meta"):
        experts = Experts(cfg)
    experts.gate_up_proj, experts.down_proj = nn.Parameter(gate_up, False), nn.Parameter(down, False)
    fp8 = {}
    for name, w in (("gate_up", gate_up), ("down", down)):
        parts = [quantize(w[e], (128, 128)) for e in range(E)]
        fp8[name] = kernels.ExpertWeights(torch.stack([v for v, _ in parts]), torch.stack([s for _, s in parts]),
                                          (128, 128))
    rows = []
    for label, n in (("decode", 32), ("prefill", 1024 if quick else 4096)):
        x = torch.randn(n, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(n, E, device=DEVICE, generator=g)
        w, idx = logits.softmax(-1).topk(k, dim=-1)
        hit = int(idx.unique().numel())
        act_bytes = n * H * 2 * 2 + n * k * inter * 2 * 2 + n * H * 4 * 2  # x, out; intermediate; fp32 atomics
        flops = 2 * n * k * 3 * H * inter
        for wname, (gu, dn), elem in (("bf16", (kernels.ExpertWeights(gate_up), kernels.ExpertWeights(down)), 2),
                                      ("fp8 128x128", (fp8["gate_up"], fp8["down"]), 1)):
            nbytes = hit * 3 * H * inter * elem + act_bytes

            def pytorch(x=x, idx=idx, w=w):
                with gpu.pytorch_ops():
                    experts(x, idx, w)
            rows.append(case_row(dev, f"moe {label} {wname}", f"N={n} E={E} k={k} H={H} I={inter}", flops, nbytes,
                                 lambda x=x, idx=idx, w=w, gu=gu, dn=dn: kernels.fused_experts(x, idx, w, gu, dn),
                                 pytorch))
    return rows  # the weights (19.3 GB in bf16) are freed with this frame


def paged_table(b: int, n: int, page: int) -> tuple[torch.Tensor, int]:
    """A shuffled block table over b * ceil(n / page) pages, as the engine's pool hands out blocks."""
    per = -(-n // page)
    return torch.randperm(b * per, device=DEVICE).view(b, per).to(torch.int32), b * per * page


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def indexer_rows(dev: Device, quick: bool) -> list[dict]:
    from openglm.kernels import dsa as kernels
    from openglm.model import gpu
    from openglm.model.glm5 import sparse_dsa

    hi, di, topk = GLM5["index_heads"], GLM5["index_dim"], GLM5["topk"]
    tk = 8192 if quick else 32768
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows = []
    for label, b, tq in (("decode", 32, 1), ("prefill", 1, 1024 if quick else 4096)):
        q = torch.randn(b, tq, hi, di, device=DEVICE, generator=g)
        w = torch.rand(b, tq, hi, device=DEVICE, generator=g) * hi ** -0.5
        keys = torch.randn(b, tk, di, device=DEVICE, dtype=torch.bfloat16, generator=g)
        table, n_rows = paged_table(b, tk, 64)
        pool = torch.empty(n_rows, di, device=DEVICE, dtype=torch.bfloat16)
        pool.view(-1, 64, di)[table.long().flatten()] = keys.view(-1, 64, di)  # sequence b's block j -> its page
        visible = b * (tq * tk - tq * (tq - 1) / 2)  # causal (query, key) pairs
        flops = 2 * visible * hi * di
        nbytes = b * tk * di * 2 + b * tq * (hi * di * 4 + tk * 4)  # keys once, queries, fp32 score rows
        for sdt in (torch.float32, torch.bfloat16):
            def kernel(q=q, w=w, sdt=sdt, pool=pool, table=table):
                kernels.indexer_topk(q, w * di ** -0.5, pool, topk, table=table, page=64, n_keys=tk, score_dtype=sdt)

            def pytorch(q=q, w=w, keys=keys, sdt=sdt):
                with gpu.pytorch_ops():
                    sparse_dsa.indexer_topk(q, keys, w, topk, score_dtype=sdt)
            rows.append(case_row(dev, f"indexer {label} {'fp32' if sdt == torch.float32 else 'bf16'}",
                                 f"B={b} Tq={tq} Tk={tk} {hi}x{di} k={topk}", flops, nbytes, kernel, pytorch))
    return rows


def attention_rows(dev: Device, quick: bool) -> list[dict]:
    from openglm.kernels import dsa as kernels
    from openglm.model import gpu
    from openglm.model.glm5 import sparse_dsa

    h, rank, rope, topk = GLM5["heads"], GLM5["rank"], GLM5["rope"], GLM5["topk"]
    d = rank + rope
    tk = 8192 if quick else 32768
    g = torch.Generator(device=DEVICE).manual_seed(2)
    rows = []
    for label, b, tq in (("decode", 32, 1), ("prefill", 1, 1024 if quick else 4096)):
        q = torch.randn(b, tq, h, d, device=DEVICE, dtype=torch.bfloat16, generator=g) * d ** -0.5
        keys = torch.randn(b, tk, 1, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
        slots = torch.rand(b, tq, tk, device=DEVICE, generator=g).topk(topk, dim=-1).indices.sort(-1).values
        scale = (192 + rope) ** -0.5
        flops = 2 * b * tq * h * topk * (d + rank)
        nbytes = b * tq * (topk * d * 2 + h * d * 2 + h * rank * 2 + topk * 4)
        if label == "decode":  # the engine's layout: kv and k_pe in their own pools, pages of 64
            table, n_rows = paged_table(b, tk, 64)
            kv = torch.empty(n_rows, rank, device=DEVICE, dtype=torch.bfloat16)
            pe = torch.empty(n_rows, rope, device=DEVICE, dtype=torch.bfloat16)
            kv.view(-1, 64, rank)[table.long().flatten()] = keys[..., 0, :rank].reshape(-1, 64, rank)
            pe.view(-1, 64, rope)[table.long().flatten()] = keys[..., 0, rank:].reshape(-1, 64, rope)

            def kernel(q=q, kv=kv, pe=pe, slots=slots, table=table):
                kernels.sparse_mla_attention(q, kv, pe, slots, scale, table=table, page=64)
        else:
            def kernel(q=q, keys=keys, slots=slots):
                kernels.sparse_mla_attention(q, keys[:, :, 0, :rank], keys[:, :, 0, rank:], slots, scale)

        def pytorch(q=q, keys=keys, slots=slots):
            k = keys.transpose(1, 2)
            with gpu.pytorch_ops():
                sparse_dsa.gather_attention(q.transpose(1, 2), k, k[..., :rank], slots, scale=scale)
        rows.append(case_row(dev, f"attention {label}", f"B={b} Tq={tq} Tk={tk} H={h} {rank}+{rope} k={topk}",
                             flops, nbytes, kernel, pytorch))
    return rows


# ---- end to end --------------------------------------------------------------------------------------------

def engine_rates(model, quick: bool, kernels: bool) -> dict:
    """Prefill and decode tokens/s of LLMEngine on the model (already on the device): n prompts of L tokens, then
    `new` tokens each. Prefill: the prompt tokens over the time until every request has its first token; decode:
    the tokens after the first over the time from then to the last. The prompts are longer than index_topk
    (2,048), so DSA selects (shorter contexts attend to every key: no top-k to compute)."""
    from openglm.engine import EngineConfig, LLMEngine, SamplingParams
    from openglm.model import gpu

    n, length, new = (4, 2560, 16) if quick else (8, 4096, 64)
    config = EngineConfig(num_kv_blocks=n * (length + new) // 16 + 64, block_size=16, max_num_seqs=n,
                          max_num_batched_tokens=8192, enable_prefix_caching=False, dtype="bfloat16", device=DEVICE)
    engine = LLMEngine(model, None, config)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def run(prompts: list[int], max_tokens: int) -> tuple[float, float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for size in prompts:
            engine.add_request(torch.randint(3, vocab, (size,), generator=g).tolist(), params)
        sync()
        t0, first = time.perf_counter(), None
        while engine.has_unfinished():
            engine.step()
            if first is None and all(s.num_output_tokens for seqs in engine.requests.values() for s in seqs):
                sync()
                first = time.perf_counter()
        sync()
        first = first or time.perf_counter()
        return first - t0, time.perf_counter() - first

    with nullcontext() if kernels else gpu.pytorch_ops():
        run([2200, 64], 4)  # warm-up: kernel compilation (with and without a top-k), the allocator
        prefill_s, decode_s = run([length] * n, new)
    return {"prefill_tok_s": n * length / prefill_s, "decode_tok_s": n * (new - 1) / decode_s,
            "shape": f"{n} prompts x {length} tokens, then {new} tokens each"}


def e2e_lines(quick: bool, preset: str = "medium") -> tuple[list[str], dict]:
    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig

    cfg = ModelConfig.from_preset(preset)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16).eval()
    rates = {}
    for label, kernels in (("Triton kernels", True), ("PyTorch ops", False)):
        try:
            rates[label] = engine_rates(model, quick, kernels)
        except Exception as exc:  # noqa: BLE001 - report and keep the other figure
            rates[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}
    shape = next((r["shape"] for r in rates.values() if "shape" in r), "")
    lines = [f"engine end to end, {preset} preset (GLM-5's head widths, DSA top-{cfg.index_topk}), bf16, {shape}:",
             f"{'':<16}{'prefill tok/s':>14}{'decode tok/s':>14}"]
    for label, r in rates.items():
        lines.append(f"{label:<16}" + (f"  failed: {r['error']}" if "error" in r else
                                       f"{r['prefill_tok_s']:>14.0f}{r['decode_tok_s']:>14.1f}"))
    return lines, rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller batches and contexts: a smoke run")
    p.add_argument("--skip-e2e", action="store_true", help="only the layer cases")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(no_device_line(), file=sys.stderr)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("bench_gpu: triton is not installed (pip install 'openglm[gpu]')", file=sys.stderr)
        return 2
    dev = Device()
    print("\n".join(dev.header()), flush=True)
    rows = []
    for part in (moe_rows, indexer_rows, attention_rows):
        try:
            rows += part(dev, args.quick)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory building one part's inputs
            rows.append({"case": part.__name__, "shape": "-", "error": f"{type(exc).__name__}: {exc}"[:120]})
        torch.cuda.empty_cache()
    print("\n".join(format_rows(dev, rows)), flush=True)
    result = {"device": dev.name, "datasheet": dev.datasheet, "measured_flops": dev.measured_flops,
              "measured_bw": dev.measured_bw, "rows": rows}
    if not args.skip_e2e:
        lines, result["e2e"] = e2e_lines(args.quick)
        print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
