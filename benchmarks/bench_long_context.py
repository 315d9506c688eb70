"""Long context in the model: speed and memory of DSA against dense attention, and the quality of the kinds.

`speed` (the default): the `small` preset (max positions raised to fit), fp32 (or --dtype bf16), batch 1, random
token ids, the same weights in DSA mode (`dsa`: its `index_topk` 128) and with dense causal attention in every
layer (`dense`); and GLM-5.3-Flash's hybrid at the small preset's width (`hybrid`: glm5_next, 8 layers in the
published mix, three KDA linear-attention layers to one pooled-DSA layer, 4 hyper-connection streams; `HYBRID`)
against the same model with dense attention in every layer (`hybrid-dense`). Per length (16K, 32K, 64K): the
prefill's time (one forward that fills the cache, logits of the last position only), the process's peak RSS and
the cache's size after it (the hybrid's: DSA latents and index keys per token, plus the fixed KDA state), then
the median decode step with that cache. Each case runs in its own subprocess (peak RSS from ru_maxrss); modes in
order, longest last.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_long_context.py [--lengths 16384,32768,65536]
        [--modes dsa,dense,hybrid,hybrid-dense] [--dtype fp32] [--decode-steps 16] [--threads 1] [--json]

`quality`: train the `small` preset with dense, local+global+random and DSA attention. Same data, same steps,
same seed; sequence length 2048. Reports the validation loss of each run (and its ratio to dense: the
write-up's ">= 92% of full-attention quality" made measurable as dense_loss / loss), plus passkey retrieval
accuracy: a 5-digit key placed more than 512 tokens (the local window) before the question.
Data: byte-level tokens of Python's own standard library source (no download), a quarter of the training
sequences carrying a passkey so the task can be learned. Tokens: 0-255 bytes, then KEY, ASK and ten digits.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_long_context.py quality [--steps 16] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

SEQ = 2048
KEY, ASK, DIGIT0 = 256, 257, 258  # special tokens after the 256 bytes
VOCAB = 320
KEY_LEN = 5
MIN_DISTANCE = 600  # key-to-question distance: always beyond the 512-token local window
RUNS = {
    "dense": dict(attention_kinds=["dense"] * 6),
    "local_global_random": dict(attention_kinds=["local_global_random"] * 6),
    "dsa": dict(attention_kinds=["dsa"] * 6, index_topk=512),  # ~ the keys per query of the LGR pattern
}


def stdlib_bytes(limit: int) -> np.ndarray:
    """Python standard library source as a byte stream (sorted files: deterministic)."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts:
            continue
        data = path.read_bytes()
        out.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if total >= limit:
            break
    return np.concatenate(out).astype(np.int64)


def passkey_doc(filler: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One SEQ-token sequence: filler text, [KEY d1..d5] somewhere early, [ASK d1..d5] at the end."""
    digits = rng.integers(0, 10, KEY_LEN) + DIGIT0
    doc = filler.copy()
    end = SEQ - 1 - KEY_LEN
    at = int(rng.integers(0, end - MIN_DISTANCE - KEY_LEN))
    doc[at] = KEY
    doc[at + 1:at + 1 + KEY_LEN] = digits
    doc[end] = ASK
    doc[end + 1:] = digits
    return doc, digits


def make_stream(text: np.ndarray, n_docs: int, passkey_share: float, seed: int) -> np.ndarray:
    """n_docs sequences of exactly SEQ tokens, so the trainer's windows (stride SEQ) are the sequences."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        start = int(rng.integers(0, len(text) - SEQ))
        doc = text[start:start + SEQ]
        docs.append(passkey_doc(doc, rng)[0] if rng.random() < passkey_share else doc)
    return np.concatenate(docs + [text[:1]])  # +1 token: the last window needs its next-token target


def passkey_accuracy(model, text: np.ndarray, n: int, seed: int) -> float:
    """Teacher-forced: fraction of key digits predicted (argmax) right after ASK; chance is 10%."""
    import torch
    rng = np.random.default_rng(seed)
    hits = 0
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            start = int(rng.integers(0, len(text) - SEQ))
            doc, digits = passkey_doc(text[start:start + SEQ], rng)
            logits = model(torch.from_numpy(doc[None, :-1])).logits[0]
            ask = SEQ - 1 - KEY_LEN  # the logits at ASK and the next 4 digits predict the 5 digits
            pred = logits[ask:ask + KEY_LEN].argmax(-1).numpy()
            hits += int((pred == digits).sum())
    return hits / (n * KEY_LEN)


def run(name: str, args, train_stream, val_stream, text_eval) -> dict:
    import torch

    from openglm.train import TrainConfig, train
    torch.set_num_threads(args.threads)
    overrides = dict(vocab_size=VOCAB, **RUNS[name])
    with tempfile.TemporaryDirectory(prefix=f"openglm-lc-{name}-") as out:
        cfg = TrainConfig(out_dir=out, preset="small", model_overrides=overrides, seq_len=SEQ, batch_size=1,
                          max_steps=args.steps, warmup_steps=max(1, args.steps // 10), lr=args.lr, dtype="fp32",
                          eval_every=args.steps, eval_windows=args.val_windows, log_every=max(1, args.steps // 5),
                          save_every=10 ** 9, plots=False, seed=0)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's warnings must not break --json
            result = train(cfg, train_tokens=train_stream, val_tokens=val_stream, log=lambda *a: None)
        train_s = time.perf_counter() - t0
        acc = passkey_accuracy(result.model, text_eval, args.passkeys, seed=123)
    return dict(kind=name, steps=result.step, val_loss=round(result.val_losses[result.step], 4),
                final_train_loss=round(result.losses[result.step], 4), passkey_acc=round(acc, 3),
                train_s=round(train_s, 1))


def quality_main(argv) -> None:
    ap = argparse.ArgumentParser(prog="bench_long_context.py quality", description="quality of the kinds vs dense")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per run (batch 1 x 2048 tokens)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--passkeys", type=int, default=16, help="passkey sequences per run for the accuracy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    text = stdlib_bytes(8 << 20)
    cut = int(len(text) * 0.9)  # validation text and passkey fillers come from files training never saw
    train_stream = make_stream(text[:cut], args.steps, passkey_share=0.25, seed=0)
    val_stream = make_stream(text[cut:], args.val_windows, passkey_share=0.0, seed=1)
    rows = []
    for name in args.runs.split(","):
        print(f"training {name} ...", file=sys.stderr, flush=True)
        rows.append(run(name, args, train_stream, val_stream, text[cut:]))
    dense = next((r for r in rows if r["kind"] == "dense"), None)
    for r in rows:
        if dense:
            r["quality_vs_dense"] = round(dense["val_loss"] / r["val_loss"], 4)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'kind':<20} {'steps':>5} {'val loss':>9} {'dense/this':>10} {'passkey acc':>11} {'train s':>8}")
    for r in rows:
        print(f"{r['kind']:<20} {r['steps']:>5} {r['val_loss']:>9.4f} {r.get('quality_vs_dense', 0):>10.4f} "
              f"{r['passkey_acc']:>11.3f} {r['train_s']:>8.1f}")
    print(f"(passkey: {KEY_LEN} digits >= {MIN_DISTANCE} tokens before the question, teacher-forced; chance 0.100)")


MiB = 1 << 20
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # torch dtype names: torch is imported in the case subprocess
LENGTHS = (16384, 32768, 65536)
# glm5_next at the `small` preset's width: 8 layers, every fourth an indexed (NoPE MLA + pooled DSA, top-128 in
# groups of 4) layer and the others KDA (8 heads x 64: KDA width twice the hidden size, as GLM-5.3-Flash's 64 x 128
# to 4096), 4 hyper-connection streams, SwiGLU clamp 10, the small preset's MoE.
HYBRID = dict(model_type="glm5_next", vocab_size=8192, hidden_size=256, intermediate_size=768,
              moe_intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=32,
              n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
              first_k_dense_replace=1, routed_scaling_factor=1.0, index_topk=128, index_head_dim=32, index_n_heads=4,
              index_kpool=4, layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(8)],
              indexer_types=["full"] * 8, linear_num_heads=8, linear_head_dim=64, linear_conv_kernel_dim=4,
              linear_lower_bound=-5.0, hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=10.0, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
PAIRS = {"dsa": "dense", "hybrid": "hybrid-dense"}  # mode -> its all-dense twin
TITLES = {"dsa": "small preset (6 layers, 4 of them with their own indexer); DSA top-128 vs dense causal",
          "hybrid": "glm5_next at small width (8 layers: 6 KDA + 2 pooled-DSA top-128, 4 streams) vs the same with "
                    "every layer dense MLA"}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_description() -> tuple[str, str]:
    """The CPU model and the ISA extensions that matter for these kernels, from /proc/cpuinfo."""
    model, flags = "", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [name for name in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512_vnni", "avx2", "fma")
           if name in flags]
    return model or platform.processor() or platform.machine(), " ".join(isa) or "none of AMX / AVX-512 / AVX2"


def speed_model(mode: str, n: int, decode_steps: int):
    """(model, empty cache) of a mode, positions for n + decode_steps tokens, seed 0."""
    import torch

    from openglm.model import DynamicCache, ModelConfig, build_model
    if mode in ("dsa", "dense"):
        cfg = ModelConfig.from_preset("small", max_position_embeddings=n + decode_steps + 2)
    else:
        cfg = ModelConfig(**HYBRID, max_position_embeddings=n + decode_steps + 2)
    if mode == "dense":
        cfg = cfg.replace(attention_kinds=["dense"] * cfg.num_hidden_layers)
    elif mode == "hybrid-dense":
        cfg = cfg.replace(layer_types=["indexed_attention"] * cfg.num_hidden_layers,
                          attention_kinds=["dense"] * cfg.num_hidden_layers)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    return model, (model.new_cache() if hasattr(model, "new_cache") else DynamicCache())


def cache_mib(cache) -> float:
    """The cache's entries (the filled part) plus any fixed linear-attention state, in MiB."""
    entries = sum(t.numel() * t.element_size() for layer in cache.layers.values() for t in layer.values())
    return (entries + getattr(cache, "state_bytes", 0)) / MiB


def speed_case(mode: str, n: int, decode_steps: int, threads: int, dtype: str = "fp32") -> dict:
    """Runs inside the subprocess: build the model, prefill n tokens into a cache, time decode steps."""
    import torch
    torch.set_num_threads(threads)
    from openglm.model.native import dsa_kernels
    model, cache = speed_model(mode, n, decode_steps)
    model = model.to(getattr(torch, DTYPES[dtype]))
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, n + decode_steps + 1), generator=torch.Generator().manual_seed(1))
    base = peak_mib()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.logits(model.hidden_states(ids[:, :n], cache=cache, last=1))
        prefill_s = time.perf_counter() - t0
        peak = peak_mib()
        size = cache_mib(cache)
        steps = []
        for i in range(decode_steps + 1):  # the first step is a warm-up
            t0 = time.perf_counter()
            model(ids[:, n + i:n + i + 1], cache=cache)
            steps.append(time.perf_counter() - t0)
    native = dsa_kernels() is not None
    return dict(mode=mode, n=n, prefill_s=round(prefill_s, 2), peak_mib=round(peak, 1), base_mib=round(base, 1),
                cache_mib=round(size, 1), decode_ms=round(1000 * statistics.median(steps[1:]), 2), native=native)


def run_speed_case(mode: str, n: int, args) -> dict:
    cmd = [sys.executable, __file__, "--case", f"{mode}:{n}", "--decode-steps", str(args.decode_steps),
           "--threads", str(args.threads), "--dtype", args.dtype]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
    except subprocess.TimeoutExpired:
        return dict(mode=mode, n=n, note=f"timed out after {args.timeout} s")
    except subprocess.CalledProcessError as e:
        return dict(mode=mode, n=n, note="failed: " + (e.stderr.strip().splitlines() or ["?"])[-1][:200])
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_speed_table(rows: list[dict], threads: int, dtype: str) -> None:
    model, isa = cpu_description()
    print(f"CPU: {model}; ISA: {isa}; {threads} torch thread(s); {dtype}, batch 1")
    by = {(r["mode"], r["n"]): r for r in rows}
    twin_of = {**PAIRS, **{dense: sparse for sparse, dense in PAIRS.items()}}
    for family in [f for f in PAIRS if any(r["mode"] in (f, PAIRS[f]) for r in rows)]:
        print(TITLES[family])
        print(f"{'mode':<12} {'N':>6} {'prefill s':>10} {'peak MiB':>9} {'cache MiB':>9} {'decode ms':>10} "
              f"{'dense/this time':>15} {'this/dense peak':>15} {'decode vs first N':>17}")
        for r in (r for r in rows if r["mode"] in (family, PAIRS[family])):
            if "note" in r:
                print(f"{r['mode']:<12} {r['n']:>6}  {r['note']}")
                continue
            other = by.get((twin_of[r["mode"]], r["n"]))
            speed = peak = "-"
            if r["mode"] == family and other and "note" not in other:
                speed = f"{other['prefill_s'] / r['prefill_s']:.2f}x"
                peak = f"{r['peak_mib'] / other['peak_mib']:.2f}x"
            first = min(x["n"] for x in rows if x["mode"] == r["mode"] and "note" not in x)
            ref = by[(r["mode"], first)]
            growth = f"{r['decode_ms'] / ref['decode_ms']:.2f}x"
            print(f"{r['mode']:<12} {r['n']:>6} {r['prefill_s']:>10.2f} {r['peak_mib']:>9.1f} {r['cache_mib']:>9.1f} "
                  f"{r['decode_ms']:>10.2f} {speed:>15} {peak:>15} {growth:>17}")
    native = {r.get("native") for r in rows if "note" not in r}
    print("DSA kernels: " + ("native (dsa_kernels.c)" if native == {True} else "torch ops" if native == {False}
                             else "mixed") + " (GLM-5's DSA; glm5_next's pooled selection and KDA run torch ops)")


def speed_main(argv) -> None:
    ap = argparse.ArgumentParser(prog="bench_long_context.py", description="the model's long-context speed and memory")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="prompt lengths in tokens (default %(default)s)")
    ap.add_argument("--modes", default="dsa,dense",
                    help="modes to run, of dsa,dense,hybrid,hybrid-dense (default %(default)s)")
    ap.add_argument("--decode-steps", type=int, default=16, help="timed decode steps after each prefill (default 16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="model dtype (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per case before it is abandoned (default 1800)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, in a subprocess
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = ap.parse_args(argv)
    if args.case:
        mode, n = args.case.split(":")
        print(json.dumps(speed_case(mode, int(n), args.decode_steps, args.threads, args.dtype)))
        return
    rows = []
    for mode in args.modes.split(","):
        for n in sorted(int(x) for x in args.lengths.split(",")):
            print(f"{mode} {n} ...", file=sys.stderr, flush=True)
            rows.append(run_speed_case(mode, n, args))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_speed_table(rows, args.threads, args.dtype)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["quality"]:
        quality_main(argv[1:])
    else:
        speed_main(argv)


if __name__ == "__main__":
    main()
