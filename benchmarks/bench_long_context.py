"""Quality of the sparse kinds: train the `small` preset with dense, local+global+random and DSA attention.

Same data, same steps, same seed; sequence length 2048. Reports the validation loss of each run (and its
ratio to dense: the write-up's ">= 92% of full-attention quality" made measurable as dense_loss / loss), plus
passkey retrieval accuracy: a 5-digit key placed more than 512 tokens (the local window) before the question.

Data: byte-level tokens of Python's own standard library source (no download), a quarter of the training
sequences carrying a passkey so the task can be learned. Tokens: 0-255 bytes, then KEY, ASK and ten digits.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_long_context.py [--steps 16] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per run (batch 1 x 2048 tokens)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-windows", type=int, default=8)
    ap.add_argument("--passkeys", type=int, default=16, help="passkey sequences per run for the accuracy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
