"""MTP self-speculative decoding: batch-1 greedy decode tokens/s through LLMEngine with and without drafts.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_mtp.py --checkpoint runs/demo [--quick]

The checkpoint needs a trained next-n layer: `openglm demo` trains the `small` preset's one (a random
layer drafts noise and is never accepted). Each request runs alone (batch 1), greedy, a fixed number of
tokens, on every engine (k = 0 and each k measured) in turn before the next request, so a noisy stretch of a
shared machine falls on all of them alike; decode tok/s counts the tokens after the first one over the time
between the first and the last (prefill excluded). Every speculative run must reproduce the plain run's
tokens exactly. The per-step columns split each engine step (prefill steps included) into the main model's
forward, the MTP layer's calls and the rest (scheduling, acceptance, sampling, detokenizing): what bounds the
speed-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402 - benchmarks/ is not a package

from openglm.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from openglm.engine.random_checkpoint import stdlib_texts  # noqa: E402


def prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    ids = tokenizer.encode("".join(stdlib_texts()))
    rng = random.Random(seed)
    return [ids[s : s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def timed(engine: LLMEngine, spent: dict) -> None:
    """Accumulate the seconds the runner spends in the main model and in the MTP layer."""
    for name, part in (("run", "main"), ("run_verify", "main"), ("run_mtp", "mtp")):
        fn = getattr(engine.runner, name)

        def wrapper(*a, _fn=fn, _part=part):
            t0 = time.perf_counter()
            try:
                return _fn(*a)
            finally:
                spent[_part] += time.perf_counter() - t0
        setattr(engine.runner, name, wrapper)


class Case:
    """One engine (k drafts per step) and what its requests measured."""

    def __init__(self, ckpt: str, k: int, max_tokens: int, warm_up: list[int]):
        self.k, self.max_tokens = k, max_tokens
        config = EngineConfig(num_speculative_tokens=k, enable_prefix_caching=False)
        self.engine = LLMEngine.from_pretrained(ckpt, config)
        self.spent = {"main": 0.0, "mtp": 0.0}
        timed(self.engine, self.spent)
        self.params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
        self.outputs, self.rates, self.elapsed = [], [], 0.0
        self.generate(warm_up)
        self.before, self.outputs, self.rates, self.elapsed = dict(self.engine.counters), [], [], 0.0
        self.spent.update(main=0.0, mtp=0.0)

    def generate(self, ids: list[int]) -> None:
        """One request alone: its tokens, and its decode tok/s after the first token."""
        t0 = time.perf_counter()
        self.engine.add_request(ids, self.params)
        t_first = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if t_first is None and out.outputs[0].token_ids:
                    t_first = time.perf_counter()
                if out.finished:
                    self.rates.append((len(out.outputs[0].token_ids) - 1) / (time.perf_counter() - t_first))
                    self.outputs.append(out.outputs[0].token_ids)
        self.elapsed += time.perf_counter() - t0

    def row(self) -> dict:
        c, b = self.engine.counters, self.before
        drafts, steps = c["draft_tokens"] - b["draft_tokens"], c["steps"] - b["steps"]
        accepted = c["accepted_draft_tokens"] - b["accepted_draft_tokens"]
        return {"k": self.k, "tok_s": statistics.median(self.rates), "outputs": self.outputs, "steps": steps,
                "acceptance": accepted / drafts if drafts else float("nan"),
                "tokens_per_step": len(self.outputs) * self.max_tokens / steps,
                "main_ms": 1e3 * self.spent["main"] / steps, "mtp_ms": 1e3 * self.spent["mtp"] / steps,
                "rest_ms": 1e3 * (self.elapsed - self.spent["main"] - self.spent["mtp"]) / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/demo", help="checkpoint or run folder (default: runs/demo)")
    ap.add_argument("--ks", default="1,2,3", help="draft counts to measure, comma-separated (default: 1,2,3)")
    ap.add_argument("--requests", type=int, default=8, help="prompts, each decoded alone (default: 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default: 32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default: 64)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    ap.add_argument("--quick", action="store_true", help="3 requests of 32 tokens, k=1,2 (default: off)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.ks = 3, 32, "1,2"
    torch.set_num_threads(args.threads)
    from openglm.model.checkpoint import resolve_checkpoint
    from openglm.tokenizer import Tokenizer

    ckpt = str(resolve_checkpoint(args.checkpoint))
    batch = prompts(Tokenizer.from_checkpoint(ckpt), args.requests, args.prompt_len)
    print(f"CPU: {cpu_model()}; torch threads: {args.threads}; checkpoint: {ckpt}")
    print(f"{args.requests} requests alone (batch 1), prompt {args.prompt_len} tokens, "
          f"{args.max_tokens} greedy tokens each")
    cases = [Case(ckpt, k, args.max_tokens, batch[0]) for k in [0] + [int(k) for k in args.ks.split(",")]]
    for ids in batch:  # each request on every engine in turn: a slow minute of a shared machine hits every k alike
        for case in cases:
            case.generate(ids)
    rows = [case.row() for case in cases]
    base = rows[0]
    print(f"\n{'drafts k':>8} {'decode tok/s':>13} {'speed-up':>9} {'acceptance':>11} {'tokens/step':>12} "
          f"{'main ms/step':>13} {'MTP ms/step':>12} {'rest ms/step':>13} {'greedy identical':>17}")
    for r in rows:
        same = "yes" if r["outputs"] == base["outputs"] else "NO"
        acc = "-" if r["k"] == 0 else f"{r['acceptance']:.1%}"
        print(f"{r['k']:>8} {r['tok_s']:>13,.1f} {r['tok_s'] / base['tok_s']:>8.2f}x {acc:>11} "
              f"{r['tokens_per_step']:>12.2f} {r['main_ms']:>13.2f} {r['mtp_ms']:>12.2f} {r['rest_ms']:>13.2f} "
              f"{same:>17}")
    return 0 if all(r["outputs"] == base["outputs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
