"""openglm against llama.cpp on the same checkpoint and thread count: prefill and batch-1 decode tokens/s.

    python benchmarks/bench_llamacpp.py [--preset small|medium] [--threads 1,2] [--pairs bf16,int8,int4] [--busy]
        [--prefill 512] [--prompt 64] [--steps 64] [--repeats 3] [--keep DIR [--prepare-only]]

Opt-in (not part of the test suite): it needs a llama-cpp-python 0.3.36 build, which `make interop` (or this
script, if the cache lacks one) builds from its source distribution with interop/build_llama_cpp.sh into
~/.cache/openglm/llama-cpp (~12 minutes on 2 cores, once). One run:
  1. builds a random-weight checkpoint: the preset's layers, experts and vocabulary with GLM-5's attention
     widths (qk 192+64, v 256, kv_lora 512, indexer 4 x 128; llama.cpp's GLM-DSA graph asserts on the small
     preset's own widths), index_topk >= every sequence here, since llama.cpp runs the DSA indexer densely,
  2. converts it with llama.cpp's own convert_hf_to_gguf.py to bf16 and Q8_0 (interop/llama_cpp_check.py), and
     the bf16 GGUF to Q4_0 with llama.cpp's own quantiser (llama_model_quantize, `pure`: every matrix Q4_0, as
     openglm's int4 quantises every matrix; without `pure` the output matrix would be Q6_K),
  3. times, per thread count and pair, openglm's engine (LLMEngine, the path `openglm serve` runs; int8 / int4 =
     EngineConfig(quantization=...), i.e. `--quantization int8|int4`) and llama.cpp: prefill of a --prefill-token
     prompt, and --steps greedy decode steps at batch 1 after a --prompt-token one.
Every llama.cpp cell (and the Q4_0 quantisation) runs in a subprocess of its own: a llama.cpp abort (a GGML_ASSERT,
a signal) becomes a row that says so, the cell is retried with llama.cpp's weight repacking off (use_extra_bufts =
false: no AMX / AVX repacked buffers), and the other cells still run.
--busy adds the busy-machine table: 2-thread decode with one competing busy process (a Python busy loop started and
ended here), against the same decode on the quiet machine, for openglm (its thread governor on, the default, and
pinned to 2 threads with OPENGLM_ADAPTIVE_THREADS=0's behaviour) and llama.cpp, interleaved quiet / busy.
Prints the CPU model and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "interop"), str(ROOT / "benchmarks")]

LLAMA_CELL = "--llama-cell"  # the subprocess mode: one llama.cpp cell, its figures as one JSON line

# GLM-5's attention widths on the preset's layers/experts (what llama.cpp's GLM-DSA graph accepts).
GLM5_HEADS = dict(q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                  index_n_heads=4, index_head_dim=128, index_topk=2048, num_nextn_predict_layers=0)
# label -> (EngineConfig overrides, llama.cpp GGUF type)
PAIRS = {"bf16": (dict(dtype="bfloat16"), "bf16"), "int8": (dict(dtype="bfloat16", quantization="int8"), "q8_0"),
         "int4": (dict(dtype="bfloat16", quantization="int4"), "q4_0")}


def median(xs):
    return sorted(xs)[len(xs) // 2]


# ---- llama.cpp, in a subprocess of its own ----------------------------------------------------------------------
def llama_cell(args) -> int:
    """Subprocess body: time one GGUF at one thread count; print {"prefill": tok/s, "decode": tok/s}."""
    import numpy as np

    sys.path.insert(0, str(Path(args.cache) / "site"))
    import llama_cpp.llama_cpp as lib  # the bindings module Llama reads its default params from
    from llama_cpp import Llama

    if args.no_repack:  # llama.cpp's model params as Llama builds them, with weight repacking off
        default = lib.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p
        lib.llama_model_default_params = no_repack
    tokens = json.loads(Path(args.tokens_file).read_text())
    prefill, prompt = tokens["prefill"], tokens["prompt"]
    llm = Llama(model_path=args.gguf, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    vocab = llm.n_vocab()
    pre, dec = [], []
    for _ in range(args.repeats + 1):  # the first round warms up
        if not args.decode_only:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prefill)
            pre.append(len(prefill) / (time.perf_counter() - t0))
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(args.steps):  # greedy: argmax of the last row's logits, fed back
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
            llm.eval([int(logits.argmax())])
        dec.append(args.steps / (time.perf_counter() - t0))
    print(json.dumps({"prefill": median(pre[1:]) if pre else None, "decode": median(dec[1:])}), flush=True)
    return 0


def run_llama(gguf: Path, threads: int, tokens_file: Path, args, decode_only: bool = False,
              no_repack: bool = False) -> dict:
    """One llama.cpp cell in a subprocess: its figures, or {"error": what happened} when it died."""
    cmd = [sys.executable, __file__, LLAMA_CELL, "--gguf", str(gguf), "--threads", str(threads), "--tokens-file",
           str(tokens_file), "--steps", str(args.steps), "--repeats", str(args.repeats), "--cache", args.cache]
    cmd += ["--decode-only"] if decode_only else []
    cmd += ["--no-repack"] if no_repack else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    why = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
    last = next((line.strip() for line in reversed(r.stderr.splitlines()) if line.strip()), "no output")
    return {"error": f"llama.cpp {'aborted' if r.returncode < 0 else 'failed'} ({why}): {last[:120]}"}


def llama_cell_with_retry(gguf: Path, threads: int, tokens_file: Path, args, **kw) -> tuple[dict, dict | None]:
    """(first try, retry with repacking off or None when the first try ran)."""
    first = run_llama(gguf, threads, tokens_file, args, **kw)
    return (first, None) if "error" not in first else (first, run_llama(gguf, threads, tokens_file, args,
                                                                       no_repack=True, **kw))


def quantize_q4_0(src: Path, dst: Path, cache: str) -> str | None:
    """The bf16 GGUF as Q4_0 through llama.cpp's own quantiser, in a subprocess; None, or why it failed."""
    code = ("import sys; sys.path.insert(0, sys.argv[3]); import llama_cpp as l; "
            "p = l.llama_model_quantize_default_params(); "
            "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_0; p.pure = True; p.nthread = 2; "
            "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(dst), str(Path(cache) / "site")],
                       capture_output=True, text=True)
    return None if r.returncode == 0 and dst.is_file() else f"llama_model_quantize failed ({r.returncode}): " \
        f"{(r.stderr.strip().splitlines() or ['no output'])[-1][:120]}"


# ---- openglm ----------------------------------------------------------------------------------------------------
def openglm_rates(engine, prefill: list[int], prompt: list[int], steps: int, repeats: int, decode_only=False):
    from openglm.engine.sampling_params import SamplingParams

    pre, dec = [], []
    for _ in range(repeats + 1):
        if not decode_only:
            engine.add_request(prefill, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            pre.append(len(prefill) / (time.perf_counter() - t0))
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prompt (and the first token)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dec.append(steps / (time.perf_counter() - t0))
    return (median(pre[1:]) if pre else None), median(dec[1:])


def set_threads(engine, threads: int, adaptive: bool) -> None:
    """The engine's thread count, with its governor (util/threads.py) over it or not."""
    import torch

    from openglm.util.threads import ThreadGovernor

    torch.set_num_threads(threads)
    engine.threads = ThreadGovernor(threads, apply=torch.set_num_threads) if adaptive and threads > 1 else None


class Competitor:
    """One busy process (a Python busy loop) for the length of a `with` block."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.5)  # let the scheduler spread it and the governor's first interval see it
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def fmt(x, width=10, digits=1):
    return f"{x:>{width},.{digits}f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def ratio(a, b):
    return f"{a / b:>5.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else f"{'-':>6}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="preset whose layers/experts/vocab are used, with GLM-5's "
                    "attention widths (default: small)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: 1,2)")
    ap.add_argument("--pairs", default="bf16,int8,int4", help="openglm / llama.cpp pairs: bf16 (bf16), int8 (Q8_0), "
                    "int4 (Q4_0) (default: bf16,int8,int4)")
    ap.add_argument("--busy", action="store_true", help="also the busy-machine table (2 threads; default off)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for the prefill figure (default: 512)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens before the decode steps (default: 64)")
    ap.add_argument("--steps", type=int, default=64, help="greedy decode steps at batch 1 (default: 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per cell, median reported (default: 3)")
    ap.add_argument("--cell-timeout", type=float, default=1800, help="seconds a llama.cpp cell may take (default 1800)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/openglm/llama-cpp"),
                    help="llama-cpp-python build folder (default: ~/.cache/openglm/llama-cpp)")
    ap.add_argument("--keep", default=None, help="keep checkpoint and GGUF files in this folder, and reuse those an "
                    "earlier run of the preset left there (default: a temporary folder)")
    ap.add_argument("--prepare-only", action="store_true", help="write the checkpoint and GGUFs (into --keep) and "
                    "stop: the untimed part, which need not wait for the benchmark lock (default off)")
    # the subprocess mode (one llama.cpp cell)
    ap.add_argument(LLAMA_CELL, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--tokens-file", help=argparse.SUPPRESS)
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-repack", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.llama_cell:
        args.threads = int(args.threads)
        return llama_cell(args)
    return benchmark(args, ap)


def benchmark(args, ap) -> int:
    import torch
    from llama_cpp_check import convert, write_tokenizer  # interop/: the same export + converter
    from machine import cpu_model, isa

    from openglm.engine.config import EngineConfig
    from openglm.engine.llm_engine import LLMEngine
    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, save_pretrained
    from openglm.model.native import decode_paths

    threads = [int(t) for t in args.threads.split(",")]
    pairs = args.pairs.split(",")
    if set(pairs) - set(PAIRS):
        ap.error(f"--pairs takes {', '.join(PAIRS)}, got {args.pairs!r}")
    sdist = ensure_llama_cpp(Path(args.cache))
    work = Path(args.keep or tempfile.mkdtemp(prefix="openglm-bench-llamacpp-"))
    ckpt = work / "checkpoint"
    cfg = ModelConfig.from_preset(args.preset, **GLM5_HEADS)
    stamp = work / f"{args.preset}.done"  # --keep: the files of an earlier run of this preset are reused
    if not stamp.is_file():
        torch.manual_seed(0)
        model = GlmMoeDsaForCausalLM(cfg).eval()
        with torch.no_grad():  # spread weights so greedy tokens vary (timings do not depend on the values)
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.05)
        save_pretrained(model, ckpt)
        write_tokenizer(ckpt)
        del model
        for f in [*work.glob("model-*.gguf"), *work.glob("*.done")]:  # another preset's files
            f.unlink()
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GlmMoeDsaForCausalLM(cfg).parameters())
    ggufs, notes = {}, []
    for label in pairs:
        outtype = PAIRS[label][1]
        ggufs[label] = work / f"model-{outtype}.gguf"
        if ggufs[label].is_file():
            continue
        if outtype == "q4_0":
            if not (work / "model-bf16.gguf").is_file():
                convert(sdist, ckpt, work / "model-bf16.gguf", "bf16")
            failed = quantize_q4_0(work / "model-bf16.gguf", ggufs[label], args.cache)
            if failed:
                notes.append(f"Q4_0: {failed}")
                ggufs[label] = None
        else:
            convert(sdist, ckpt, ggufs[label], outtype)
    stamp.touch()
    if args.prepare_only:
        print(f"prepared {work}: checkpoint and GGUFs ({', '.join(f.name for f in sorted(work.glob('*.gguf')))})")
        return 0
    gen = torch.Generator().manual_seed(1)
    prefill = torch.randint(3, cfg.vocab_size, (args.prefill,), generator=gen).tolist()
    prompt = prefill[:args.prompt]
    tokens_file = work / "tokens.json"
    tokens_file.write_text(json.dumps({"prefill": prefill, "prompt": prompt}))

    print(f"CPU: {cpu_model()} ({isa()}); torch {torch.__version__}; load average {os.getloadavg()[0]:.1f} "
          f"(1 min) at start")
    print(f"openglm decode kernels: {decode_paths()}")
    print(f"checkpoint: {args.preset} preset + GLM-5 attention widths, {n_params / 1e6:,.1f}M parameters; llama.cpp: "
          f"llama-cpp-python 0.3.36, GGML_NATIVE; Q4_0 by llama_model_quantize (pure)")
    print(f"prefill: {args.prefill}-token prompt; decode: batch 1, {args.steps} greedy steps after {args.prompt} "
          f"tokens; median of {args.repeats}; each llama.cpp cell in its own process")
    for note in notes:
        print(f"note: {note}")
    print(f"\n{'threads':>7} {'openglm':>8} {'llama.cpp':>9} | {'prefill tok/s':>23} {'ratio':>6} | "
          f"{'decode tok/s':>21} {'ratio':>6}")
    print(f"{'':>7} {'':>8} {'':>9} | {'openglm':>11} {'llama.cpp':>11} {'':>6} | {'openglm':>10} "
          f"{'llama.cpp':>10} {'':>6}")
    engines = {}
    for label in pairs:
        engines[label] = LLMEngine.from_pretrained(ckpt, EngineConfig(enable_prefix_caching=False, **PAIRS[label][0]))
    for t in threads:
        for label in pairs:
            set_threads(engines[label], t, adaptive=False)  # the quiet table: exactly t threads
            op, od = openglm_rates(engines[label], prefill, prompt, args.steps, args.repeats)
            outtype = PAIRS[label][1]
            if ggufs[label] is None:
                print(f"{t:>7} {label:>8} {outtype:>9} | {fmt(op, 11, 0)} {'-':>11} {'-':>6} | {fmt(od)} "
                      f"{'-':>10} {'-':>6}  (no {outtype} GGUF)", flush=True)
                continue
            first, retry = llama_cell_with_retry(ggufs[label], t, tokens_file, args)
            tries = [(first, "")] + ([(retry, " (retry, repacking off)")] if retry is not None else [])
            for res, how in tries:
                if "error" in res:
                    print(f"{t:>7} {label:>8} {outtype:>9} | {fmt(op, 11, 0)} {'-':>11} {'-':>6} | {fmt(od)} "
                          f"{'-':>10} {'-':>6}  {res['error']}{how}", flush=True)
                else:
                    print(f"{t:>7} {label:>8} {outtype:>9} | {fmt(op, 11, 0)} {fmt(res['prefill'], 11, 0)} "
                          f"{ratio(op, res['prefill'])} | {fmt(od)} {fmt(res['decode'])} {ratio(od, res['decode'])}"
                          f"{how}", flush=True)
    if args.busy:
        busy_table(engines, ggufs, pairs, prefill, prompt, tokens_file, args)
    print(f"\nload average {os.getloadavg()[0]:.1f} (1 min) at the end")
    return 0


def busy_table(engines, ggufs, pairs, prefill, prompt, tokens_file, args) -> None:
    """2-thread decode, quiet and with one busy competitor, interleaved per pair."""
    print("\nbusy machine: 2-thread batch-1 decode tok/s, quiet and with one competing busy process (a Python busy "
          "loop)")
    print(f"{'pair':>6} {'run':<30} {'quiet':>8} {'busy':>8} {'busy/quiet':>11}")
    for label in pairs:
        rows = []
        for name, adaptive in (("openglm (thread governor)", True), ("openglm (2 threads pinned)", False)):
            set_threads(engines[label], 2, adaptive)
            _, quiet = openglm_rates(engines[label], prefill, prompt, args.steps, args.repeats, decode_only=True)
            set_threads(engines[label], 2, adaptive)
            with Competitor():
                _, busy = openglm_rates(engines[label], prefill, prompt, args.steps, args.repeats, decode_only=True)
            governed = engines[label].threads.current if engines[label].threads is not None else 2
            rows.append((f"{name}", quiet, busy, f" (ran {governed} thread(s) busy)" if adaptive else ""))
        if ggufs[label] is not None:
            quiet = run_llama(ggufs[label], 2, tokens_file, args, decode_only=True)
            with Competitor():
                busy = run_llama(ggufs[label], 2, tokens_file, args, decode_only=True)
            rows.append((f"llama.cpp {PAIRS[label][1]}", quiet.get("decode"), busy.get("decode"),
                         "" if "error" not in quiet and "error" not in busy else
                         f" {quiet.get('error') or busy.get('error')}"))
        for name, quiet, busy, note in rows:
            print(f"{label:>6} {name:<30} {fmt(quiet, 8)} {fmt(busy, 8)} {ratio(busy, quiet):>11}{note}", flush=True)


def ensure_llama_cpp(cache: Path) -> Path:
    """The unpacked sdist (its converter); builds llama-cpp-python into `cache` first if it is not there."""
    if not (cache / "site" / "llama_cpp" / "__init__.py").exists():
        print(f"building llama-cpp-python into {cache} (interop/build_llama_cpp.sh, ~12 min on 2 cores)", flush=True)
        subprocess.run(["bash", str(ROOT / "interop" / "build_llama_cpp.sh"), str(cache)], check=True,
                       env={**os.environ, "PY": sys.executable})
    return next(cache.glob("llama_cpp_python-*/"))


if __name__ == "__main__":
    raise SystemExit(main())
