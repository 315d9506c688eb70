"""Two training runs for `openglm doctor` to look at (docs/doctor.md; tests/doctor use them too).

    python examples/doctor/make_cases.py OUT      # writes OUT/healthy and OUT/sick

Each is a run folder as `openglm train` leaves it: metrics.jsonl and checkpoints/step_N with its `latest` pointer.
The telemetry is written here rather than trained (a real collapse takes hours to show): 40 log records of a
tiny MoE (2 MoE layers x 8 experts, top-2). The healthy run's experts share the tokens evenly and its loss falls
smoothly; the sick run has the write-up's imbalance (layer 1's expert 3 takes 95% of the tokens, experts 5 and 6
get none), a loss spike and a gradient-norm spike at step 250, and a checkpoint whose chat template (ChatML) writes
markers its GLM tokenizer has no token for. Both checkpoints are random-weight tiny models with a real tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STEPS, EVERY, LAYERS, EXPERTS, TOP_K = 400, 10, 2, 8, 2


def telemetry(sick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    records = [{"kind": "val", "step": 0, "val_loss": 6.2, "val_ppl": float(np.exp(6.2)), "unigram_loss": 5.6}]
    for step in range(EVERY, STEPS + 1, EVERY):
        lm = 3.4 + 2.6 * np.exp(-step / 120) + rng.normal(0, 0.02)
        grad = 0.8 + 0.4 * np.exp(-step / 100) + rng.normal(0, 0.02)
        share = np.full((LAYERS, EXPERTS), TOP_K / EXPERTS) + rng.normal(0, 0.01, (LAYERS, EXPERTS))
        if sick:
            share[1] = [0.15, 0.15, 0.15, 0.95, 0.3, 0.0, 0.0, 0.3]  # sums to top_k = 2 (each token picks 2)
            if step == 250:
                lm, grad = lm + 1.5, 30.0
        tokens = 4096
        counts = np.round(share * tokens).clip(min=0)
        records.append({"kind": "train", "step": step, "loss": lm, "lm_loss": lm, "aux_loss": 0.0, "balance_loss": 0.0,
                        "grad_norm": grad, "router_grad_norm": 0.05, "lr": 3e-3, "tokens_per_s": 2500.0,
                        "expert_counts": counts.tolist(), "expert_share": share.round(4).tolist(),
                        "expert_cv": (share.std(axis=1) / share.mean(axis=1)).round(4).tolist(),
                        "max_expert_share": float(share.max()), "dropped_fraction": 0.0})
        if step % 100 == 0:
            val = lm + 0.15
            records.append({"kind": "val", "step": step, "val_loss": val, "val_ppl": float(np.exp(val))})
    return records


def make_run(folder: Path, sick: bool) -> Path:
    from openglm.engine.random_checkpoint import (
        build_random_checkpoint,  # torch: only when writing a checkpoint
    )

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in telemetry(sick)))
    ckpt = build_random_checkpoint(folder / "checkpoints" / f"step_{STEPS:07d}")
    (folder / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    if sick:
        (ckpt / "chat_template.jinja").write_text(CHATML)
    return folder


def main(out: str) -> None:
    for name in ("healthy", "sick"):
        print(make_run(Path(out) / name, sick=name == "sick"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/doctor")
