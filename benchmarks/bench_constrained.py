"""Constrained decoding overhead: the grammar masks' share of decode time in continuous batching.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_constrained.py [--batch 8] [--json]

Builds a random-weight checkpoint (preset `--preset`, a BPE tokenizer of `--vocab` tokens trained on
stdlib sources), then decodes `--batch` sequences at once through the engine: unconstrained (the
same-run anchor), then with every sequence under the server's grammar for a flat two-tool schema
(tool_choice "required"), for a rich one (a nested model by `$ref`, an Optional via `anyOf`, enums,
bounded integers, a raw string with a pattern, an array with maxItems) and for `response_format`
json_schema with the rich schema, thinking off and on (the prompt opens the reasoning, the grammar holds
from `</think>` on, and a thinking budget of a quarter of the tokens forces `</think>`: that row's grammar
time includes the budget's). The table reports decode time per step, the mean number of rows a
step decoded (a constrained sequence ends when its grammar is complete) and the time spent in
llguidance (mask computation + application + advancing the matchers) as a share of decode. Each run is
repeated `--repeats` times and the repeat with the median share is reported (the machine may be shared).
Target: < 15% at batch 8.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_model  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)


def stdlib_corpus(mb: float) -> list[str]:
    """Up to `mb` megabytes of the interpreter's standard library sources (always present, no download)."""
    root, texts, total = Path(os.__file__).parent, [], 0
    for f in sorted(root.rglob("*.py")):
        if total > mb * 1e6:
            break
        text = f.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
    return texts


FLAT_TOOLS = [
    {"type": "function", "function": {"name": "run_shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"}},
        "required": ["path"]}}}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "country": {"enum": ["FR", "DE", "JP", "US"], "type": "string"}},
        "required": ["name", "country"]}
RICH = {"$defs": {"City": CITY}, "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12},
                       "city": {"$ref": "#/$defs/City"},
                       "alternative": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"enum": ["C", "F"], "type": "string"},
                       "note": {"type": ["string", "null"], "maxLength": 24},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["code", "city", "days", "unit"]}
RICH_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": RICH}}, FLAT_TOOLS[0]]


def grammars(tokenizer) -> list[tuple[str, str, bool]]:
    """(row name, grammar, thinking) for each constrained run: the server's grammar for each request shape."""
    from openglm.server.protocol import ChatCompletionRequest
    from openglm.server.structured import request_grammar

    ask = [{"role": "user", "content": "x"}]
    rich_format = dict(response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": RICH}})
    shapes = [("tool_choice=required, flat schema", dict(tools=FLAT_TOOLS, tool_choice="required"), False),
              ("tool_choice=required, rich schema", dict(tools=RICH_TOOLS, tool_choice="required"), False),
              ("response_format json_schema, rich", rich_format, False),
              ("response_format json_schema, rich, thinking on + budget", rich_format, True)]
    return [(name, request_grammar(ChatCompletionRequest(messages=ask, **kw), tokenizer, thinking=thinking), thinking)
            for name, kw, thinking in shapes]


def run(engine, prompts, params) -> dict:
    """Decode all prompts together; time the steps and the grammar work inside them."""
    grammar_s = [0.0]
    g, budget = engine.grammar, engine.thinking
    mask, advance, force = g.apply_masks, g.advance, budget.apply

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                grammar_s[0] += time.perf_counter() - t
        return wrapper

    g.apply_masks, g.advance, budget.apply = timed(mask), timed(advance), timed(force)
    try:
        for p in prompts:
            engine.add_request(p, params)
        while engine.has_unfinished() and engine.scheduler.num_unfinished and not _all_decoding(engine):
            engine.step()  # prefill first: only decode steps are measured
        grammar_s[0], steps, rows = 0.0, 0, 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            rows += len(engine.scheduler.running)
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
    finally:
        g.apply_masks, g.advance, budget.apply = mask, advance, force
    return {"steps": steps, "rows_per_step": rows / max(steps, 1), "ms_per_step": 1000 * wall / max(steps, 1),
            "grammar_ms_per_step": 1000 * grammar_s[0] / max(steps, 1),
            "grammar_share": grammar_s[0] / wall if wall else 0.0}


def median(engine, prompts, params, repeats: int, key: str) -> dict:
    """The run (of `repeats`) with the median `key`: one run's figures, less exposed to a busy moment."""
    runs = sorted((run(engine, prompts, params) for _ in range(max(repeats, 1))), key=lambda r: r[key])
    return runs[len(runs) // 2]


def _all_decoding(engine) -> bool:
    return all(s.num_computed_tokens >= s.num_prompt_tokens for seqs in engine.requests.values() for s in seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per sequence (default 64)")
    ap.add_argument("--preset", default="tiny", help="model preset of the random checkpoint (default tiny)")
    ap.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size asked of BPE training "
                    "(default 4096; training text limits what it reaches)")
    ap.add_argument("--corpus-mb", type=float, default=0.0, help="train the tokenizer on this many MB of the "
                    "Python stdlib instead of a few files (default 0: the few files), for large vocabularies")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each row; the median-share one is reported")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.engine.random_checkpoint import build_random_checkpoint
    from openglm.engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        texts = stdlib_corpus(args.corpus_mb) if args.corpus_mb else None
        ckpt = build_random_checkpoint(Path(tmp) / "ckpt", preset=args.preset, vocab_size=args.vocab, texts=texts)
        engine = LLMEngine.from_pretrained(ckpt, EngineConfig(max_num_seqs=max(args.batch, 8)))
        tok = engine.tokenizer
        vocab = tok.vocab_size  # what BPE training reached (at most --vocab)
        prompts = {thinking: [tok.apply_chat_template([{"role": "user", "content": f"task {i}: list the files"}],
                                                      tokenize=True, enable_thinking=thinking)
                              for i in range(args.batch)] for thinking in (False, True)}
        stops = tok.stop_ids
        base = dict(max_tokens=args.tokens, temperature=1.0, seed=0, stop_token_ids=stops)
        think = dict(thinking_budget=args.tokens // 4, think_ids=(tok.marker_id("<think>"), tok.marker_id("</think>")))
        rows = [("unconstrained (anchor)", median(engine, prompts[False], SamplingParams(**base, ignore_eos=True),
                                                  args.repeats, "ms_per_step"))]
        for name, grammar, thinking in grammars(tok):
            params = SamplingParams(**base, grammar=grammar, **(think if thinking else {}))
            rows.append((name, median(engine, prompts[thinking], params, args.repeats, "grammar_share")))
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "batch": args.batch, "preset": args.preset, "vocab": vocab,
                          "runs": {name: r for name, r in rows}}, indent=2))
        return
    print(f"CPU: {cpu_model()}  threads={args.threads}  preset={args.preset}  vocab={vocab}  batch={args.batch}  "
          f"repeats={args.repeats} (median)")
    print("| run | decode steps | rows/step | ms/step | llguidance ms/step | llguidance share of decode |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['steps']} | {r['rows_per_step']:.1f} | {r['ms_per_step']:.2f} | "
              f"{r['grammar_ms_per_step']:.3f} | {100 * r['grammar_share']:.1f}% |")
    worst = max(r["grammar_share"] for _, r in rows[1:])
    print(f"largest llguidance share: {100 * worst:.1f}%  (target: < 15%)")


if __name__ == "__main__":
    main()
