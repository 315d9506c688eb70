"""A training run, from its metrics.jsonl: expert-load imbalance and dead experts (the write-up's "some experts
persistently > 90% busy, others < 10%"), loss spikes, gradient norms, divergence, dropped tokens, and validation
against the unigram baseline.

Expert load is the trainer's token share (telemetry.py): the fraction of a layer's tokens that picked the expert.
Over the last quarter of the run, an expert above 90% of the tokens is hot (the trainer's collapse threshold); one
below 10% of the even share (top_k / n_experts) is starved, and one that saw no token at all is dead.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from openglm.doctor.report import Check, error, info, ok, warn
from openglm.train.telemetry import read_metrics

HOT_SHARE = 0.9  # of a layer's tokens
STARVED = 0.1  # of the even share
SPIKE_NATS = 0.5  # a loss jump smaller than this is noise, however flat the curve before it
SPIKE_MADS = 5.0  # ... and it must stand this many median absolute deviations above the recent median
GRAD_SPIKE = 10.0  # a gradient norm this many times the median of the run so far
DROPPED = 0.05  # tokens dropped by capacity limits


def check_run(run: Path) -> list[Check]:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return [info("run.telemetry", f"no metrics.jsonl in {run}: nothing to say about the training itself")]
    records = read_metrics(metrics)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    out = [ok("run.telemetry", f"telemetry: {len(train)} training records to step "
              f"{train[-1]['step'] if train else 0}, {len(val)} validations")]
    out += _diverged([r for r in records if r.get("kind") == "error"])
    if train:
        out += _expert_load(train) + [_loss_spikes(train), _grad_norms(train)] + _dropped(train)
    if val:
        out += _validation(val, train)
    return out


def window(train: list[dict]) -> list[dict]:
    """The records the load checks judge: the last quarter of the run (at least 3 records when there are)."""
    return train[-max(3, len(train) // 4):]


def _expert_load(train: list[dict]) -> list[Check]:
    loads = [r for r in window(train) if r.get("expert_share")]
    if not loads:
        return [info("run.expert_load", "no expert-load telemetry (a dense model, or logged before it existed)")]
    share = np.mean([np.asarray(r["expert_share"], dtype=np.float64) for r in loads], axis=0)  # [layers, experts]
    counts = np.sum([np.asarray(r.get("expert_counts", r["expert_share"]), dtype=np.float64) for r in loads], axis=0)
    top_k = max(1, round(float(share.sum(axis=1).max())))
    layers, experts = share.shape
    even = top_k / experts
    span = f"steps {loads[0]['step']}-{loads[-1]['step']}"
    router = float(np.mean([r.get("router_grad_norm", math.nan) for r in loads]))
    hot = [(layer, e) for layer in range(layers) for e in range(experts) if share[layer, e] > HOT_SHARE]
    starved = [(layer, e) for layer in range(layers) for e in range(experts) if share[layer, e] < STARVED * even]
    dead = [(layer, e) for layer, e in starved if counts[layer, e] == 0]
    data = {"hot": hot, "starved": starved, "dead": dead, "top_k": top_k, "experts": experts, "window": span,
            "router_grad_norm": router, "max_share": float(share.max())}
    fix = ("the write-up's remedies: check that the routers are updating (router_grad_norm in metrics.jsonl"
           f"{'' if math.isnan(router) else f' is {router:.2g} here'}); raise the expert capacity factor "
           "(--set capacity_factor=1.25); add a load-balancing loss when retraining (--set switch_loss_coef=0.01, or "
           "a stronger aux-loss-free bias: --router-bias-rate 1e-2)")
    out = []
    if hot:
        out.append(warn("run.expert_load", f"expert-load imbalance over {span}: {_pairs(hot, share)} above "
                        f"{HOT_SHARE:.0%} of the tokens while {len(starved)} expert(s) get under {STARVED:.0%} of the "
                        f"even share ({even:.1%})" + (" and the routers' gradient norm is 0: they are not learning"
                                                      if router == 0 else ""), fix, **data))
    else:
        out.append(ok("run.expert_load", f"expert load over {span}: the busiest expert takes {share.max():.0%} of its "
                      f"layer's tokens (even share {even:.1%})", **data))
    if starved:
        dead_text = f", {len(dead)} of them dead (no token at all)" if dead else ""
        out.append(warn("run.dead_experts", f"{len(starved)} starved expert(s) over {span} (under {STARVED:.0%} of "
                        f"the even share){dead_text}: {_pairs(starved, share)}: their parameters learn nothing",
                        "the remedies of the imbalance above: a balance loss or the aux-loss-free router bias "
                        "(--router-bias-rate) sends tokens back to them", **data))
    else:
        out.append(ok("run.dead_experts", f"no starved expert over {span} (each above {STARVED:.0%} of the even "
                      "share)"))
    return out


def _pairs(pairs: list[tuple[int, int]], share: np.ndarray, most: int = 6) -> str:
    text = ", ".join(f"MoE layer {layer} expert {e} ({share[layer, e]:.0%})" for layer, e in pairs[:most])
    return text + (f" and {len(pairs) - most} more" if len(pairs) > most else "")


def _loss_spikes(train: list[dict]) -> Check:
    steps = [r["step"] for r in train]
    loss = np.asarray([r.get("lm_loss", r.get("loss", math.nan)) for r in train], dtype=np.float64)
    spikes = []
    for i in range(3, len(loss)):
        recent = loss[max(0, i - 5):i]
        base = float(np.median(recent))
        mad = float(np.median(np.abs(recent - base)))
        if loss[i] - base > max(SPIKE_NATS, SPIKE_MADS * mad):
            spikes.append((steps[i], float(loss[i] - base)))
    if spikes:
        where = ", ".join(f"step {s} (+{d:.2f} nats)" for s, d in spikes[:6])
        return warn("run.loss_spikes", f"{len(spikes)} loss spike(s): {where}",
                    "lower the learning rate (--lr) or lengthen the warm-up (--warmup-steps); keep gradient clipping "
                    "on (--grad-clip 1.0); resume from the checkpoint before the spike (--resume CHECKPOINT)",
                    spikes=spikes)
    return ok("run.loss_spikes", f"no loss spike (LM loss {loss[0]:.3f} -> {loss[-1]:.3f})")


def _grad_norms(train: list[dict]) -> Check:
    steps = [r["step"] for r in train]
    g = np.asarray([r.get("grad_norm", math.nan) for r in train], dtype=np.float64)
    if np.isnan(g).all():
        return info("run.grad_norm", "no gradient norms in the telemetry")
    bad = [steps[i] for i in range(len(g)) if not math.isfinite(g[i])]
    if bad:
        return error("run.grad_norm", f"non-finite gradient norms at steps {', '.join(map(str, bad[:6]))}",
                     "lower the learning rate, keep --grad-clip on, train in bf16 autocast rather than fp16",
                     steps=bad)
    spikes = [(steps[i], float(g[i])) for i in range(3, len(g)) if g[i] > GRAD_SPIKE * float(np.median(g[:i]))]
    if spikes:
        where = ", ".join(f"step {s} ({v:.3g})" for s, v in spikes[:6])
        return warn("run.grad_norm", f"gradient-norm spikes (over {GRAD_SPIKE:.0f}x the run's median "
                    f"{float(np.median(g)):.3g}): {where}", "keep --grad-clip on (1.0 clips them); if they "
                    "recur, lower --lr", spikes=spikes)
    return ok("run.grad_norm", f"gradient norm {g[0]:.3g} -> {g[-1]:.3g}, no spike", first=float(g[0]),
              last=float(g[-1]))


def _diverged(errors: list[dict]) -> list[Check]:
    if not errors:
        return []
    e = errors[-1]
    return [error("run.diverged", f"training diverged at step {e.get('step')} (LM loss {e.get('lm_loss')}, aux "
                  f"{e.get('aux_loss')}): the step was not applied",
                  "resume from the last checkpoint with a lower --lr (and --grad-clip 1.0)")]


def _dropped(train: list[dict]) -> list[Check]:
    dropped = [r["dropped_fraction"] for r in window(train) if "dropped_fraction" in r]
    if dropped and float(np.mean(dropped)) > DROPPED:
        return [warn("run.dropped_tokens", f"{float(np.mean(dropped)):.1%} of routed tokens dropped by expert "
                     "capacity", "raise --set capacity_factor (or null for dropless routing)")]
    return []


def _validation(val: list[dict], train: list[dict]) -> list[Check]:
    last = val[-1]
    unigram = next((r["unigram_loss"] for r in val if "unigram_loss" in r), None)
    if unigram is not None and last["val_loss"] >= unigram:
        return [warn("run.validation", f"validation loss {last['val_loss']:.3f} at step {last['step']} is no better "
                     f"than the unigram baseline {unigram:.3f}: the model has learned next to nothing",
                     "train longer (the demo's --train-seconds), check the data (--data) and the learning rate")]
    best = min(val, key=lambda r: r["val_loss"])
    if last["val_loss"] > best["val_loss"] + 0.1 and len(train) > 1 and \
            train[-1].get("lm_loss", 0) < train[0].get("lm_loss", 0):
        return [info("run.validation", f"validation loss rose from {best['val_loss']:.3f} (step {best['step']}) to "
                     f"{last['val_loss']:.3f} while the training loss fell: overfitting",
                     "more data, fewer steps, or the checkpoint of the best step")]
    return [ok("run.validation", f"validation loss {last['val_loss']:.3f} at step {last['step']}"
               + (f" (unigram baseline {unigram:.3f})" if unigram is not None else ""))]
