"""openglm against llama.cpp on the same checkpoint and thread count: prefill and batch-1 decode tokens/s.

    python benchmarks/bench_llamacpp.py [--threads 1,2] [--prefill 512] [--prompt 64] [--steps 64]

Opt-in (not part of the test suite): it needs a llama-cpp-python 0.3.36 build, which `make interop` (or this
script, if the cache lacks one) builds from its source distribution with interop/build_llama_cpp.sh into
~/.cache/openglm/llama-cpp (~12 minutes on 2 cores, once). One run:
  1. builds a random-weight checkpoint: the small preset's layers, experts and vocabulary with GLM-5's attention
     widths (qk 192+64, v 256, kv_lora 512, indexer 4 x 128; llama.cpp's GLM-DSA graph asserts on the small
     preset's own widths), index_topk >= every sequence here, since llama.cpp runs the DSA indexer densely,
  2. converts it with llama.cpp's own convert_hf_to_gguf.py to bf16 and Q8_0 (interop/llama_cpp_check.py),
  3. times, per thread count, llama.cpp (llama-cpp-python) and openglm's engine (LLMEngine, the path
     `openglm serve` runs; int8 = EngineConfig(quantization="int8"), i.e. `--quantization int8`):
     prefill of a --prefill-token prompt, and --steps greedy decode steps at batch 1 after a --prompt-token one.
Prints one table (medians of --repeats) with openglm / llama.cpp ratios, and the CPU model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "interop"), str(ROOT / "benchmarks")]

from llama_cpp_check import convert, write_tokenizer  # noqa: E402  (interop/: the same export + converter)
from machine import cpu_model  # noqa: E402

from openglm.engine.config import EngineConfig  # noqa: E402
from openglm.engine.llm_engine import LLMEngine  # noqa: E402
from openglm.engine.sampling_params import SamplingParams  # noqa: E402
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, save_pretrained  # noqa: E402

# GLM-5's attention widths on the small preset's layers/experts (what llama.cpp's GLM-DSA graph accepts).
GLM5_HEADS = dict(q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                  index_n_heads=4, index_head_dim=128, index_topk=2048, num_nextn_predict_layers=0)
# (label, EngineConfig overrides) for openglm; (label, converter --outtype) for llama.cpp, paired row by row
PAIRS = [("bf16", dict(dtype="bfloat16"), "bf16"), ("int8", dict(dtype="bfloat16", quantization="int8"), "q8_0")]


def ensure_llama_cpp(cache: Path) -> Path:
    """The unpacked sdist (its converter); builds llama-cpp-python into `cache` first if it is not there."""
    if not (cache / "site" / "llama_cpp" / "__init__.py").exists():
        print(f"building llama-cpp-python into {cache} (interop/build_llama_cpp.sh, ~12 min on 2 cores)", flush=True)
        subprocess.run(["bash", str(ROOT / "interop" / "build_llama_cpp.sh"), str(cache)], check=True,
                       env={**os.environ, "PY": sys.executable})
    sys.path.insert(0, str(cache / "site"))
    return next(cache.glob("llama_cpp_python-*/"))


def make_checkpoint(preset: str, folder: Path) -> ModelConfig:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(preset, **GLM5_HEADS)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():  # spread weights so greedy tokens vary (timings do not depend on the values)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    save_pretrained(model, folder)
    write_tokenizer(folder)
    return cfg


def median(xs):
    return sorted(xs)[len(xs) // 2]


def llama_cpp_rates(gguf: Path, threads: int, prefill: list[int], prompt: list[int], steps: int, repeats: int):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    pre, dec = [], []
    for _ in range(repeats + 1):  # the first round warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prefill)
        pre.append(len(prefill) / (time.perf_counter() - t0))
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(steps):  # greedy: argmax of the last row's logits, fed back
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
            llm.eval([int(logits.argmax())])
        dec.append(steps / (time.perf_counter() - t0))
    return median(pre[1:]), median(dec[1:])


def openglm_rates(engine: LLMEngine, prefill: list[int], prompt: list[int], steps: int, repeats: int):
    pre, dec = [], []
    for _ in range(repeats + 1):
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
    return median(pre[1:]), median(dec[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", help="preset whose layers/experts/vocab are used, with GLM-5's "
                    "attention widths (default: small)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: 1,2)")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for the prefill figure (default: 512)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens before the decode steps (default: 64)")
    ap.add_argument("--steps", type=int, default=64, help="greedy decode steps at batch 1 (default: 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per cell, median reported (default: 3)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/openglm/llama-cpp"),
                    help="llama-cpp-python build folder (default: ~/.cache/openglm/llama-cpp)")
    ap.add_argument("--keep", default=None, help="keep checkpoint and GGUF files in this folder (default: temp)")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    sdist = ensure_llama_cpp(Path(args.cache))
    work = Path(args.keep or tempfile.mkdtemp(prefix="openglm-bench-llamacpp-"))
    ckpt = work / "checkpoint"
    cfg = make_checkpoint(args.preset, ckpt)
    ggufs = {}
    for _, _, outtype in PAIRS:
        ggufs[outtype] = work / f"model-{outtype}.gguf"
        convert(sdist, ckpt, ggufs[outtype], outtype)
    gen = torch.Generator().manual_seed(1)
    prefill = torch.randint(3, cfg.vocab_size, (args.prefill,), generator=gen).tolist()
    prompt = prefill[:args.prompt]

    print(f"CPU: {cpu_model()}; torch {torch.__version__}; checkpoint: {args.preset} preset + GLM-5 attention "
          f"widths, {sum(p.numel() for p in GlmMoeDsaForCausalLM(cfg).parameters()) / 1e6:.1f}M parameters")
    print(f"prefill: {args.prefill}-token prompt; decode: batch 1, {args.steps} greedy steps after "
          f"{args.prompt} tokens; median of {args.repeats}")
    print(f"{'threads':>7} {'openglm':>8} {'llama.cpp':>9} | {'prefill tok/s':>23} {'ratio':>6} | "
          f"{'decode tok/s':>21} {'ratio':>6}")
    print(f"{'':>7} {'':>8} {'':>9} | {'openglm':>11} {'llama.cpp':>11} {'':>6} | {'openglm':>10} "
          f"{'llama.cpp':>10} {'':>6}")
    engines = {label: LLMEngine.from_pretrained(ckpt, EngineConfig(enable_prefix_caching=False, **over))
               for label, over, _ in PAIRS}
    for t in threads:
        torch.set_num_threads(t)
        for label, _, outtype in PAIRS:
            op, od = openglm_rates(engines[label], prefill, prompt, args.steps, args.repeats)
            lp, ld = llama_cpp_rates(ggufs[outtype], t, prefill, prompt, args.steps, args.repeats)
            print(f"{t:>7} {label:>8} {outtype:>9} | {op:>11,.0f} {lp:>11,.0f} {op / lp:>5.2f}x | "
                  f"{od:>10,.1f} {ld:>10,.1f} {od / ld:>5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
