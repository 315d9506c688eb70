"""Weight-only quantisation against the checkpoint's own dtype: held-out perplexity, one run.

    .venv/bin/python benchmarks/bench_quant_quality.py [--checkpoint runs/demo] [--kinds bf16,int8,int4-32,...]

For a run folder of `openglm train` / `openglm demo` (default runs/demo: the demo checkpoint, trained on the Python
standard library), it rebuilds the run's held-out split exactly as training did (same documents, same tokenizer,
`train.data.split_documents` with the run's val_fraction), cuts it into non-overlapping windows of the run's
seq_len, and reports per quantisation the mean next-token loss and perplexity over every window, with the change
against the unquantised bf16 model. The quantised models run the inference paths (`quantize_model`, the kernels
`--quantization` uses: int4 reads packed codes in place). Kinds: bf16, fp32, int8, int4-G (G = 32, 64, 128: the
group size). Prints the CPU model and the kernel paths the run took.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from machine import cpu_model, isa  # noqa: E402

from openglm.engine.quant import model_weight_bytes, quantize_model  # noqa: E402
from openglm.model import load_model  # noqa: E402
from openglm.model.checkpoint import resolve_checkpoint  # noqa: E402
from openglm.model.native import decode_paths  # noqa: E402
from openglm.tokenizer import Tokenizer  # noqa: E402
from openglm.train.checkpoint import load_trainer_state  # noqa: E402
from openglm.train.data import load_documents, split_documents, tokenize_documents  # noqa: E402


def held_out_windows(checkpoint: Path, max_windows: int) -> tuple[np.ndarray, dict]:
    """The run's validation documents (its train config from the checkpoint's trainer state), tokenized as training
    did, as [n, seq_len + 1] windows."""
    cfg = load_trainer_state(checkpoint)["train_config"]
    data, val_fraction, seq_len = cfg["data"], cfg["val_fraction"], cfg["seq_len"]
    _, val = split_documents(load_documents(data), val_fraction)
    tokens = tokenize_documents(val, Tokenizer.from_checkpoint(checkpoint))
    available = (len(tokens) - 1) // seq_len
    n = min(available, max_windows)
    windows = np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
    return windows, {"data": data, "val_documents": len(val), "val_tokens": len(tokens), "seq_len": seq_len,
                     "available": available}


def mean_loss(model, windows: np.ndarray, batch: int) -> float:
    total, count = 0.0, 0
    with torch.inference_mode():
        for chunk in torch.from_numpy(windows).split(batch):
            logits = model(chunk[:, :-1]).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += chunk[:, 1:].numel()
    return total / count


def build(checkpoint: Path, kind: str):
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model = load_model(str(checkpoint), dtype=dtype)
    if kind.startswith("int4"):
        quantize_model(model, "int4", group=int(kind.split("-")[1]))
    elif kind == "int8":
        quantize_model(model, "int8")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="runs/demo", help="run folder or checkpoint (default: runs/demo)")
    ap.add_argument("--kinds", default="bf16,int8,int4-32,int4-64,int4-128",
                    help="comma-separated: bf16, fp32, int8, int4-32, int4-64, int4-128 (default: %(default)s)")
    ap.add_argument("--max-windows", type=int, default=1000, help="held-out windows at most (default: 1000)")
    ap.add_argument("--batch", type=int, default=16, help="windows per forward (default: 16)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in ("bf16", "fp32", "int8", "int4-32", "int4-64", "int4-128")]
    if bad:
        ap.error(f"--kinds: unknown {', '.join(bad)}")
    checkpoint = resolve_checkpoint(args.checkpoint)
    windows, info = held_out_windows(checkpoint, args.max_windows)
    print(f"CPU: {cpu_model()} ({isa()}); {torch.get_num_threads()} thread(s); decode kernels: {decode_paths()}")
    print(f"checkpoint {checkpoint}; held-out split of {info['data']!r}: {info['val_documents']} documents, "
          f"{info['val_tokens']:,} tokens; {len(windows)} of its {info['available']} windows of {info['seq_len']} "
          f"tokens scored\n")
    print(f"{'weights':<10}{'weight MB':>10}{'loss':>9}{'perplexity':>12}{'vs bf16':>9}{'seconds':>9}")
    base = None
    for kind in kinds:
        model = build(checkpoint, kind)
        t0 = time.perf_counter()
        loss = mean_loss(model, windows, args.batch)
        base = loss if kind == "bf16" else base
        delta = f"{100 * (math.exp(loss - base) - 1):>+8.2f}%" if base is not None else f"{'':>9}"
        print(f"{kind:<10}{model_weight_bytes(model) / 1e6:>10.1f}{loss:>9.4f}{math.exp(loss):>12.2f}{delta}"
              f"{time.perf_counter() - t0:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
