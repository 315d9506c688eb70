"""Serving benchmark: offline throughput vs transformers, online latency over HTTP, KV bytes per
token (MLA latent vs uncompressed K/V), and int8/fp8 weight quantisation (memory and quality).

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_serve.py [--quick] [--json]

Without --checkpoint it builds a random-weight `small` checkpoint (with a BPE tokenizer trained on
stdlib sources) in a temp folder: throughput and latency do not depend on the weights' values.
Both engines get the same torch thread count (--threads) and the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def workload(tokenizer, n: int, seed: int, prompt_range, output_range):
    """n prompts cut from real text (mixed lengths) and a mixed output length for each."""
    from openglm.engine.random_checkpoint import stdlib_texts

    ids = tokenizer.encode("".join(stdlib_texts()))
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
        outs.append(rng.randint(*output_range))
    return prompts, outs


# ---- 1. offline throughput ------------------------------------------------------------------------
def bench_offline(ckpt: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    from openglm.engine import LLM, SamplingParams

    llm = LLM(str(ckpt), num_kv_blocks=4096, max_num_seqs=args.num_prompts, max_num_batched_tokens=2048)
    prompts, outs = workload(llm.tokenizer, args.num_prompts, 0, args.prompt_len, args.output_len)
    useful = sum(outs)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    engine_out = llm.generate(prompts, params, use_tqdm=True)
    engine_s = time.perf_counter() - t0
    rows = [{"system": f"openglm engine (max_num_seqs={args.num_prompts})", "seconds": engine_s,
             "output_tok_s": useful / engine_s, "steps": llm.engine.stats().steps}]
    kv_bytes_per_token = llm.engine.runner.pool.bytes_per_token()
    del llm

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    agree = 0
    for bs in args.hf_batch_sizes:
        t0 = time.perf_counter()
        for b0 in range(0, len(prompts), bs):
            batch, lens = prompts[b0:b0 + bs], outs[b0:b0 + bs]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(batch):  # left padding, as generate expects
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.no_grad():
                gen = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False, pad_token_id=0)
            if bs == args.hf_batch_sizes[0]:
                for i, n in enumerate(lens):
                    agree += gen[i, width:width + n].tolist() == engine_out[b0 + i].outputs[0].token_ids
        secs = time.perf_counter() - t0
        rows.append({"system": f"transformers generate (batch {bs}, padded)", "seconds": secs,
                     "output_tok_s": useful / secs, "steps": None})
    best_hf = max(r["output_tok_s"] for r in rows[1:])
    return {"rows": rows, "speedup_vs_best_transformers": rows[0]["output_tok_s"] / best_hf,
            "num_prompts": len(prompts), "useful_output_tokens": useful, "prompt_tokens": sum(map(len, prompts)),
            "greedy_identical_requests": f"{agree}/{len(prompts)}", "kv_bytes_per_token_measured": kv_bytes_per_token}


# ---- 2. online latency over HTTP -------------------------------------------------------------------
async def _one_request(client, body) -> dict:
    t0 = time.perf_counter()
    ttft, stamps, n_tokens = None, [], 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - t0
                stamps.append(now)
    e2e = time.perf_counter() - t0
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    tpot = (e2e - ttft) / max(n_tokens - 1, 1) if ttft is not None else float("nan")
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "tokens": n_tokens}


async def _run_level(url, prompts, outs, concurrency) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def go(p, n):
            async with sem:
                return await _one_request(client, {"model": "bench", "prompt": p, "max_tokens": n, "temperature": 0,
                                                   "stream": True, "ignore_eos": True,
                                                   "stream_options": {"include_usage": True}})

        t0 = time.perf_counter()
        res = await asyncio.gather(*[go(p, n) for p, n in zip(prompts, outs)])
        wall = time.perf_counter() - t0
    ms = lambda xs, q: 1000 * pct(xs, q)  # noqa: E731
    ttft, tpot, itl = [r["ttft"] for r in res], [r["tpot"] for r in res], [x for r in res for x in r["itl"]]
    return {"concurrency": concurrency, "requests": len(res), "req_s": len(res) / wall,
            "output_tok_s": sum(r["tokens"] for r in res) / wall,
            "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "tpot_p50_ms": ms(tpot, 50),
            "tpot_p99_ms": ms(tpot, 99), "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99)}


def bench_online(ckpt: Path, args) -> list[dict]:
    import httpx

    from openglm.engine.tokenizing import EngineTokenizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "openglm", "serve", str(ckpt), "--port", str(port), "--served-model-name", "bench",
           "--threads", str(args.threads), "--num-kv-blocks", "4096", "--max-num-seqs", "32", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("openglm serve did not start")
                time.sleep(0.3)
        tok = EngineTokenizer(ckpt)
        levels = []
        for conc in args.concurrency:
            n = max(args.online_min_requests, 2 * conc)
            prompts, outs = workload(tok, n, conc, args.prompt_len, (args.online_output, args.online_output))
            levels.append(asyncio.run(_run_level(url, prompts, outs, conc)))
            print(f"online concurrency {conc}: {levels[-1]['req_s']:.2f} req/s", file=sys.stderr)
        return levels
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- 3. KV cache bytes per token -------------------------------------------------------------------
def kv_bytes(cfg, elem_bytes: int) -> dict:
    """Bytes one token occupies in the cache, summed over layers: MLA latent (+ rope key + the DSA
    indexer key on layers with their own indexer) vs the expanded per-head K and V."""
    layers = cfg.num_hidden_layers
    own_indexer = sum(1 for t in cfg.indexer_types if t == "full") if cfg.indexer_types else layers
    latent = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + own_indexer * cfg.index_head_dim
    full = layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return {"mla_latent": latent * elem_bytes, "uncompressed_kv": full * elem_bytes, "ratio": full / latent}


def bench_kv_memory(ckpt: Path, measured: int) -> list[dict]:
    """The benchmarked checkpoint (with the engine pool's measured bytes) and the published GLM-5 shape."""
    from openglm.model import ModelConfig

    cfg = ModelConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    return [{"model": f"benchmarked ({cfg.num_hidden_layers} layers)", "dtype": "fp32", **kv_bytes(cfg, 4),
             "measured_engine_pool": measured},
            {"model": "glm-5 preset (78 layers)", "dtype": "bf16", **kv_bytes(ModelConfig.from_preset("glm-5"), 2)}]


# ---- 4. quantisation -------------------------------------------------------------------------------
def bench_quant(ckpt: Path, args) -> list[dict]:
    from openglm.engine import LLM, SamplingParams
    from openglm.engine.quant import model_weight_bytes

    text_ids = None
    rows, ref_logits, ref_greedy = [], None, None
    for kind in (None, "int8", "fp8"):
        llm = LLM(str(ckpt), num_kv_blocks=512, quantization=kind)
        model = llm.engine.runner.model
        if text_ids is None:  # held-out text (not among the tokenizer's training files)
            import shutil
            text_ids = llm.tokenizer.encode(Path(shutil.__file__).read_text())[: args.ppl_tokens]
        with torch.no_grad():
            logits = model(torch.tensor([text_ids])).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(text_ids[1:]))
        prompts, _ = workload(llm.tokenizer, 8, 5, (16, 64), (1, 1))
        greedy = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)]
        if kind is None:
            ref_logits, ref_greedy = logits, greedy
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        same = sum(a == b for g, r in zip(greedy, ref_greedy) for a, b in zip(g, r))
        rows.append({"weights": kind or "fp32", "model_mib": model_weight_bytes(model) / 2**20,
                     "perplexity": float(torch.exp(nll)), "top1_agreement": top1,
                     "greedy_tokens_same": same / sum(map(len, ref_greedy))})
        del llm
    base = rows[0]["perplexity"]
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["perplexity"] - base) / base
    return rows


# ---- report ----------------------------------------------------------------------------------------
def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(("-" if r.get(k) is None else format(r[k], f)) for k, _, f in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def report(res: dict) -> str:
    off = res["offline"]
    out = [f"## Offline: {off['num_prompts']} prompts ({off['prompt_tokens']} prompt tokens, "
           f"{off['useful_output_tokens']} output tokens), threads={res['threads']}",
           table(off["rows"], [("system", "system", "s"), ("seconds", "seconds", ".1f"),
                               ("output_tok_s", "output tok/s", ".1f"), ("steps", "engine steps", "d")]),
           f"speed-up vs the best transformers batch size: **{off['speedup_vs_best_transformers']:.2f}x**; "
           f"greedy outputs identical to transformers: {off['greedy_identical_requests']} requests", "",
           "## Online (HTTP, streaming, `openglm serve`)",
           table(res["online"], [("concurrency", "concurrency", "d"), ("requests", "requests", "d"),
                                 ("req_s", "req/s", ".2f"), ("output_tok_s", "out tok/s", ".1f"),
                                 ("ttft_p50_ms", "TTFT p50 ms", ".0f"), ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
                                 ("tpot_p50_ms", "TPOT p50 ms", ".1f"), ("tpot_p99_ms", "TPOT p99 ms", ".1f"),
                                 ("itl_p50_ms", "ITL p50 ms", ".1f"), ("itl_p99_ms", "ITL p99 ms", ".1f")]), "",
           "## KV cache bytes per token (all layers)",
           table(res["kv_memory"], [("model", "model", "s"), ("dtype", "dtype", "s"),
                                    ("mla_latent", "MLA latent + rope + indexer key", "d"),
                                    ("uncompressed_kv", "uncompressed K/V", "d"), ("ratio", "ratio", ".1f"),
                                    ("measured_engine_pool", "measured (engine pool)", "d")]), "",
           "## Weight-only quantisation",
           table(res["quant"], [("weights", "weights", "s"), ("model_mib", "model MiB", ".2f"),
                                ("perplexity", "perplexity", ".2f"), ("ppl_delta_pct", "ppl delta %", "+.2f"),
                                ("top1_agreement", "top-1 agreement", ".3f"),
                                ("greedy_tokens_same", "greedy tokens same", ".3f")])]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint folder (default: a random-weight `small` one in a temp dir)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--online-output", type=int, default=32, help="output tokens per online request")
    ap.add_argument("--online-min-requests", type=int, default=8)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines and the server")
    ap.add_argument("--quick", action="store_true", help="a smaller run (16 prompts, shorter outputs)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    ap.add_argument("--from-json", metavar="FILE", help="only print the tables of a saved --json run")
    args = ap.parse_args(argv)
    if args.from_json:
        print(report(json.loads(Path(args.from_json).read_text())))
        return 0
    if args.quick:
        args.num_prompts, args.output_len, args.hf_batch_sizes = 16, (8, 48), [16]
        args.concurrency, args.online_output, args.ppl_tokens = [1, 8], 16, 256
    from openglm.model.checkpoint import resolve_checkpoint

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        ckpt = resolve_checkpoint(args.checkpoint) if args.checkpoint else None
        if ckpt is None:
            from openglm.engine.random_checkpoint import build_random_checkpoint

            ckpt = build_random_checkpoint(Path(tmp) / args.preset, preset=args.preset, vocab_size=4096)
        res = {"threads": args.threads, "checkpoint": str(args.checkpoint or f"random {args.preset}")}
        res["offline"] = bench_offline(ckpt, args)
        res["online"] = bench_online(ckpt, args)
        res["kv_memory"] = bench_kv_memory(ckpt, res["offline"]["kv_bytes_per_token_measured"])
        res["quant"] = bench_quant(ckpt, args)
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
