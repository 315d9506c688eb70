"""`openglm demo`: train the `small` preset on the Python standard library for a few minutes, then show
what it learned (validation loss before/after against a unigram baseline, and a code completion)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from collections import deque
from pathlib import Path

from openglm.train.config import RECIPES, TrainConfig

PROMPT = "def fibonacci(n):"
TRAIN_SECONDS = 240.0  # training time the demo aims for; the step count is calibrated to this machine


def run_demo(out_dir: str = "runs/demo", steps: int | None = None, train_seconds: float = TRAIN_SECONDS,
             prompt: str = PROMPT, progress: bool = True, **overrides) -> dict:
    """Run the demo recipe; returns (and writes to <out_dir>/summary.json) the numbers it printed.

    Without `steps`, the number of steps is calibrated so training takes about `train_seconds` here, then
    re-timed after every step (`Retimer`): a machine that becomes busy mid-run gets a shorter schedule that still
    ends (warmup + full cosine) within the budget; a hard stop at 1.5x is the last guard.
    """
    from openglm.train.data import unigram_loss  # torch: loaded when the demo runs
    from openglm.train.generate import generate
    from openglm.train.trainer import Trainer

    started = time.perf_counter()
    shutil.rmtree(Path(out_dir) / "checkpoints", ignore_errors=True)  # the demo's own folder: start clean
    cfg = TrainConfig(**{**RECIPES["demo"], "out_dir": out_dir, "progress": progress, **overrides})
    _say(f"openglm demo: training the {cfg.preset!r} preset on the Python standard library -> {cfg.out_dir}/")
    trainer = Trainer(cfg)
    cap, retime = cfg.max_steps, steps is None
    if retime:
        steps = calibrate_steps(trainer, train_seconds, cap=cap)
        cfg = cfg.replace(time_budget_s=1.5 * train_seconds)
    cfg = cfg.replace(max_steps=steps, save_every=max(steps, cap), eval_every=max(1, -(-steps // 4)),
                      warmup_steps=min(cfg.warmup_steps, max(1, steps // 10)))
    trainer.cfg = trainer.tracker.cfg = cfg
    mc = trainer.model_config
    n_params = sum(p.numel() for p in trainer.model.parameters())
    _say(f"model: {n_params / 1e6:.1f}M parameters, {mc.num_hidden_layers} layers, {mc.n_routed_experts} experts "
         f"(top-{mc.num_experts_per_tok}); {cfg.max_steps} steps of {cfg.batch_size * cfg.grad_accum} x "
         f"{cfg.seq_len} tokens, {cfg.dtype} autocast")
    unigram = unigram_loss(trainer.train_tokens, trainer.val_tokens, mc.vocab_size)
    t0 = time.perf_counter()
    before = trainer.evaluate()
    eval_s = time.perf_counter() - t0
    trainer.metrics.write({"kind": "val", "step": 0, "val_loss": before, "val_ppl": math.exp(before),
                           "unigram_loss": unigram})
    retimer = Retimer(train_seconds, cap=cap, reserve_s=eval_s) if retime else None
    result = trainer.run(replan=retimer)
    if retimer is not None and result.step != steps:
        _say(f"re-timed: {result.step} steps instead of {steps} (the machine ran at {retimer.pace():.2f}s per step, "
             f"evaluations included), so the schedule ended within the ~{train_seconds:.0f} s budget")
    after = result.val_losses[result.step]
    _say(f"\nsample completion of {prompt!r} (temperature 0.5, top-k 40):\n")
    print(prompt, end="", flush=True)
    sample = generate(trainer.model, trainer.tokenizer, prompt, max_new_tokens=120, temperature=0.5, top_k=40,
                      top_p=0.95, seed=0, stream=lambda s: print(s, end="", flush=True))
    print("\n")
    summary = {"val_loss_before": before, "val_loss_after": after, "unigram_loss": unigram, "steps": result.step,
               "tokens_per_s": result.tokens_per_s, "wall_s": time.perf_counter() - started,
               "sample": prompt + sample, "checkpoint": str(result.checkpoint), "out_dir": str(result.out_dir)}
    (Path(cfg.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    _report(summary, Path(cfg.out_dir))
    return summary


class Retimer:
    """The schedule length that still ends within a wall-clock budget, re-estimated after each step (a `replan`
    for Trainer.run). The pace is the slower of the recent steps' median (a machine that became busy shows within a
    few steps) and the average since the start (which counts the evaluations and checkpoints between steps);
    `reserve_s` is kept for the final evaluation and checkpoint."""

    def __init__(self, budget_s: float, cap: int, reserve_s: float = 0.0, window: int = 8, clock=time.perf_counter):
        self.budget_s, self.cap, self.reserve_s, self.clock = budget_s, cap, reserve_s, clock
        self.created = clock()
        self.start = self.last = None
        self.recent: deque[float] = deque(maxlen=window)
        self.calls = 0

    def pace(self) -> float:
        """Seconds per step, as planned with (0 before the second step)."""
        if not self.calls:
            return 0.0
        return max(statistics.median(self.recent), (self.last - self.start) / self.calls)

    def __call__(self, step: int) -> int | None:
        now = self.clock()
        if self.start is None:  # the first step carries one-off costs (allocations, thread start): pace from after it
            self.start = self.last = now
            return None
        self.recent.append(now - self.last)
        self.last, self.calls = now, self.calls + 1
        left = self.budget_s - self.reserve_s - (now - self.created)
        return min(self.cap, step + max(0, int(left / max(self.pace(), 1e-9))))


def calibrate_steps(trainer, seconds: float, cap: int, floor: int = 20) -> int:
    """Steps that fit in `seconds`, from timing forward+backward on one batch (data position restored)."""
    import torch  # heavy: loaded when the demo runs

    cfg = trainer.cfg
    position = trainer.batcher.state_dict()
    batch = torch.from_numpy(trainer.batcher.next_batch(cfg.batch_size))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        lm, aux, _ = trainer._forward(batch[:, :-1], batch[:, 1:])
        (lm + aux).backward()
        times.append(time.perf_counter() - t0)
    trainer.model.zero_grad(set_to_none=True)
    trainer.batcher.load_state_dict(position)
    per_step = min(times[1:]) * cfg.grad_accum * 1.1  # + optimizer step and telemetry
    steps = max(floor, min(cap, int(seconds / per_step)))
    span = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    _say(f"calibration: {per_step:.2f}s per step here -> {steps} steps for ~{span} of training")
    return steps


def _report(s: dict, out: Path) -> None:
    _say("validation loss (nats/token):")
    _say(f"  unigram baseline   {s['unigram_loss']:.3f}  (perplexity {math.exp(s['unigram_loss']):,.0f})")
    _say(f"  before training    {s['val_loss_before']:.3f}  (perplexity {math.exp(s['val_loss_before']):,.0f})")
    _say(f"  after {s['steps']:>4} steps   {s['val_loss_after']:.3f}  "
         f"(perplexity {math.exp(s['val_loss_after']):,.1f})")
    _say(f"throughput {s['tokens_per_s']:,.0f} tokens/s; whole demo {s['wall_s'] / 60:.1f} min")
    _say(f"checkpoint: {s['checkpoint']}  (try: openglm generate {s['checkpoint']} --prompt 'import os')")
    _say(f"plots:      {out / 'loss.png'}, {out / 'expert_load.png'}")
    _say(f"metrics:    {out / 'metrics.jsonl'}; summary: {out / 'summary.json'}")


def _say(msg: str) -> None:
    print(msg, flush=True)
