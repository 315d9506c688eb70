"""The training loop: AdamW + warmup/cosine, clipping, MoE aux losses, bf16 autocast, accumulation,
data parallelism, periodic validation, telemetry, atomic checkpoints and exact resume.

Python API (also used by benchmarks):

    from openglm.train import TrainConfig, train
    result = train(TrainConfig(out_dir="runs/x", preset="tiny", max_steps=50), train_tokens=tokens)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from openglm.model.checkpoint import load_model, resolve_checkpoint
from openglm.model.errors import CheckpointError
from openglm.model.model import build_model
from openglm.model.parallel import ParallelLayout, check_training_layout
from openglm.train import dist, dist_checkpoint, parallelize
from openglm.train.activations import enable_activation_checkpointing
from openglm.train.checkpoint import load_trainer_state, rng_state, save_checkpoint, set_rng_state
from openglm.train.config import TrainConfig
from openglm.train.data import PackedBatcher, eval_windows
from openglm.train.optim import build_optimizer, clip_grad_norm
from openglm.train.prepare import (
    TrainSetupError,
    build_model_config,
    check_resume_compatible,
    check_vocab,
    prepare_output,
    prepare_tokens,
    split_stream,
    stderr_log,
)
from openglm.train.schedule import lr_at
from openglm.train.telemetry import MetricsLog
from openglm.train.tracker import ROUTER_SUFFIX, StepTracker
from openglm.util.threads import ThreadGovernor


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf: training stopped before applying that step."""


@dataclass
class TrainResult:
    model: torch.nn.Module
    model_config: object
    tokenizer: object
    out_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss (mean over the step)
    val_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    checkpoint: Path | None = None


def train(cfg: TrainConfig, model_config=None, tokenizer=None, train_tokens=None, val_tokens=None,
          resume=None, stop_at: int | None = None, log=stderr_log) -> TrainResult:
    """Train per `cfg`. Data: cfg.data, or pre-tokenized int streams `train_tokens`/`val_tokens`.

    resume: None (fresh), True (latest checkpoint in cfg.out_dir) or a checkpoint path.
    stop_at: stop after this step (with a checkpoint) although the schedule runs to cfg.max_steps.
    """
    trainer = Trainer(cfg, model_config, tokenizer, train_tokens, val_tokens, resume, log)
    try:
        return trainer.run(stop_at)
    finally:
        dist.teardown(trainer.info)


class Trainer:
    def __init__(self, cfg: TrainConfig, model_config=None, tokenizer=None, train_tokens=None, val_tokens=None,
                 resume=None, log=stderr_log):
        # A bad layout is refused before any process group starts.
        self.layout = ParallelLayout.parse(cfg.parallel) if cfg.parallel else None
        if self.layout is not None:
            check_training_layout(self.layout, model_config or build_model_config(cfg, None),
                                  int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg, self.info = cfg, dist.setup(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # CPU threads follow the cores other processes leave free (util/threads.py), re-checked before each step
        self.threads = ThreadGovernor.for_torch() if torch.device(cfg.device).type == "cpu" else None
        self.log = log if self.info.is_main else (lambda *_: None)
        self.out = prepare_output(cfg.out_dir)
        if train_tokens is None:
            tokenizer, train_tokens, val_tokens = prepare_tokens(cfg, self.out, self.info, tokenizer, self.log)
        elif val_tokens is None:
            train_tokens, val_tokens = split_stream(np.asarray(train_tokens), cfg.val_fraction)
        self.tokenizer = tokenizer
        self.train_tokens, self.val_tokens = np.asarray(train_tokens), np.asarray(val_tokens)
        self.model_config = model_config or build_model_config(cfg, tokenizer)
        check_vocab(self.model_config, tokenizer, int(max(self.train_tokens.max(), self.val_tokens.max())))
        self.batcher = PackedBatcher(self.train_tokens, cfg.seq_len, seed=cfg.seed)
        self.val_windows = eval_windows(self.val_tokens, cfg.seq_len, cfg.eval_windows)
        self.step, self.checkpoint = 0, None
        self._build_model()
        self.metrics = MetricsLog(self.out / "metrics.jsonl", enabled=self.info.is_main)
        self.tracker = StepTracker(self.model_config, cfg, self.info)
        if resume:
            self._resume(resume)
        elif self.info.is_main and self.metrics.path.exists():
            self.metrics.path.unlink()  # a fresh run in an old folder starts a fresh log

    # ---- setup
    def _build_model(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.device = torch.device(self.cfg.device if self.cfg.device != "cuda" else f"cuda:{self.info.local_rank}")
        self.model = build_model(self.model_config).to(self.device)
        self.model.train()
        self._trains_mtp = self.model_config.num_nextn_predict_layers > 0 and self.cfg.mtp_loss_weight > 0
        if self.cfg.activation_checkpointing:
            enable_activation_checkpointing(self.model, self.cfg.activation_checkpointing)
        self.par = None
        if self.layout is not None:  # every rank built the same full model (same seed); shard it now
            if self.cfg.offload_optimizer:
                raise TrainSetupError("--offload-optimizer is not supported with --parallel (FSDP2 shards "
                                      "the optimizer state instead)")
            self.par = parallelize.build_meshes(self.layout, self.device.type)
            parallelize.parallelize(self.model, self.par)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.par is not None:
            self.optimizer = parallelize.build_optimizer(self.model, self.cfg.lr, (self.cfg.beta1, self.cfg.beta2),
                                                         self.cfg.weight_decay)
        else:
            self.optimizer = build_optimizer(self.model, self.cfg.lr, (self.cfg.beta1, self.cfg.beta2),
                                             self.cfg.weight_decay, offload=self.cfg.offload_optimizer)

    def _resume(self, resume) -> None:
        ckpt = resolve_checkpoint(self.out if resume is True else resume)
        state = load_trainer_state(ckpt)
        check_resume_compatible(ckpt, self.model_config, self.cfg, state["train_config"])
        if state.get("world", 1) != self.info.world:
            raise CheckpointError(f"cannot resume from {ckpt}: it was trained on {state.get('world', 1)} processes, "
                                  f"this run has {self.info.world} (the global batch and data order would change)")
        if self.par is not None:
            dist_checkpoint.load(self.par, self.model, self.optimizer, ckpt, state)
        else:
            if state.get("parallel"):
                raise CheckpointError(f"cannot resume from {ckpt}: it was trained with layout {state['parallel']}; "
                                      "resume it with the same --parallel")
            saved = load_model(ckpt, dtype=torch.float32)
            self.model.load_state_dict(saved.state_dict())
            del saved
            self.optimizer.load_state_dict(state["optimizer"])
        self.batcher.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        if "tracker" in state:  # checkpoints written before the tracker state was saved resume without it
            self.tracker.load_state_dict(state["tracker"])
        self.step, self.checkpoint = state["step"], ckpt
        self.metrics.truncate_after(self.step)
        self.log(f"resumed from {ckpt} at step {self.step}")

    # ---- loop
    def run(self, stop_at: int | None = None, replan=None) -> TrainResult:
        """Train to cfg.max_steps (or `stop_at`). `replan(step) -> int | None`, called after each step: a new length
        for the schedule (the warmup + cosine then ends there, with as many validations as planned), e.g. the steps a
        time budget still allows."""
        from tqdm import tqdm  # only for a progress bar

        cfg = self.cfg
        result = TrainResult(self.model, self.model_config, self.tokenizer, self.out, self.step)
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.info.is_main))
        trained_s, tokens = 0.0, 0
        evals = max(1, cfg.max_steps // cfg.eval_every)  # validations per schedule, kept when replan changes its length
        while self.step < self._end(stop_at):
            if self.threads is not None:
                self.threads.poll()
            t0 = time.perf_counter()
            loss = self._train_step()
            dt = time.perf_counter() - t0
            trained_s += dt
            tokens += cfg.seq_len * cfg.batch_size * cfg.grad_accum * self.info.world
            self.tracker.add_time(dt)
            result.losses[self.step] = loss
            bar.update(1)
            bar.set_postfix(self._bar_figures(tokens / trained_s))
            if self.step % cfg.log_every == 0:
                self._log_train(bar)
            if replan is not None:
                cfg = self._set_max_steps(replan(self.step), bar, evals)
            out_of_time = dist.any_rank(cfg.time_budget_s is not None and trained_s >= cfg.time_budget_s, self.info)
            done = self.step >= self._end(stop_at) or out_of_time
            if self.step % cfg.eval_every == 0 or done:
                result.val_losses[self.step] = self.evaluate_and_log()
            if self.step % cfg.save_every == 0 or done:
                self.save()
            if out_of_time:
                self.log(f"time budget of {cfg.time_budget_s:.0f}s reached at step {self.step}")
                break
        bar.close()
        result.step, result.checkpoint = self.step, self.checkpoint
        result.tokens_per_s = tokens / trained_s if trained_s else 0.0
        if cfg.plots and self.info.is_main:
            from openglm.train.plots import plot_run  # matplotlib: only when plots are asked for

            plot_run(self.out)
        return result

    def _end(self, stop_at: int | None) -> int:
        return self.cfg.max_steps if stop_at is None else min(stop_at, self.cfg.max_steps)

    def _set_max_steps(self, steps: int | None, bar, evals: int) -> TrainConfig:
        """A new schedule length (at least the steps done; every rank takes rank 0's, so they stop together), with
        `evals` validations spread over it."""
        asked = self.info.is_main and steps is not None
        got = dist.all_reduce_sum(torch.tensor([steps if asked else 0, asked], dtype=torch.float64), self.info)
        if got[1] > 0:
            steps = max(int(got[0]), self.step)
            if steps != self.cfg.max_steps:
                self.cfg = self.tracker.cfg = self.cfg.replace(max_steps=steps, eval_every=max(1, -(-steps // evals)))
                bar.total = steps
                bar.refresh()
        return self.cfg

    def _train_step(self) -> float:
        cfg, info = self.cfg, self.info
        self._lr = lr_at(self.step, cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr
        per_rank = cfg.batch_size * cfg.grad_accum
        batch = torch.from_numpy(self.batcher.next_batch(per_rank * info.world, info.rank, info.world))
        # lm loss, aux loss (MTP's weighted share included), micro-steps, MTP loss
        sums = torch.zeros(4, dtype=torch.float64)
        counts = None  # this step's tokens per expert, [n_moe_layers, n_experts]
        for micro in batch.split(cfg.batch_size):
            micro = micro.to(self.device)
            lm, aux, stats = self._forward(micro[:, :-1], micro[:, 1:])
            ((lm + aux) / cfg.grad_accum).backward()
            sums += torch.tensor([lm.item(), float(aux.detach()), 1.0, float(self._mtp_loss.detach())],
                                 dtype=torch.float64)
            c = self.tracker.add_routing(stats)
            if c is not None:
                counts = c if counts is None else counts + c
        if self.par is not None:  # FSDP2 averaged the dense gradients in backward
            parallelize.reduce_expert_gradients(self.par)
        else:
            dist.average_gradients(self.params, info)
        sums = dist.all_reduce_sum(sums, info)
        lm_loss, aux_loss = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
        if not math.isfinite(lm_loss + aux_loss):
            self._diverged(lm_loss, aux_loss)
        if self.par is not None:
            router = [p for n, p in self.model.named_parameters() if n.endswith(ROUTER_SUFFIX)]
            router_norm = float(parallelize.global_grad_norm(self.par, router))
            grad_norm = parallelize.clip_gradients(self.par, self.params, cfg.grad_clip)
        else:
            router_norm = self.tracker.router_grad_norm(self.model)
            grad_norm = clip_grad_norm(self.params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if counts is not None and cfg.router_bias_rate > 0:
            self._nudge_router_bias(dist.all_reduce_sum(counts, info))
        self.step += 1
        self.tracker.add_step(lm_loss, aux_loss, grad_norm, router_norm, self._lr,
                              (sums[3] / sums[2]).item() if self._trains_mtp else None)
        return lm_loss + aux_loss

    def _bar_figures(self, tokens_per_s: float) -> dict:
        """The progress bar's figures: the LM loss (comparable with the validation loss; the weighted aux and
        MTP terms are logged apart), the MTP layer's own loss when it trains, throughput and learning rate."""
        lm, mtp = self.tracker.rows[-1][0], self.tracker.rows[-1][5]
        figures = {"loss": f"{lm:.3f}"} | ({"mtp": f"{mtp:.3f}"} if self._trains_mtp else {})
        return figures | {"tok_s": f"{tokens_per_s:,.0f}", "lr": f"{self._lr:.2e}"}

    @torch.no_grad()
    def _nudge_router_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 / GLM-5): raise the score bias of under-loaded experts and
        lower it for over-loaded ones by a fixed rate; the bias only affects which experts are chosen."""
        routers = [layer.mlp.gate for layer in self.model.model.layers
                   if hasattr(layer.mlp, "gate") and getattr(layer.mlp.gate, "kind", None) == "sigmoid"]
        for router, load in zip(routers, counts):
            step = torch.sign(load.mean() - load).to(router.e_score_correction_bias)
            router.e_score_correction_bias.add_(self.cfg.router_bias_rate * step)

    def _forward(self, inputs: torch.Tensor, targets: torch.Tensor):
        bf16 = self.cfg.dtype == "bf16"
        mtp = self._trains_mtp and inputs.shape[1] > 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = self.model(inputs, aux=True, mtp=mtp)
        logits = out.logits.float()
        lm = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        aux = out.aux.aux_loss.float() if out.aux is not None else torch.zeros((), device=lm.device)
        self._mtp_loss = lm.new_zeros(())
        if mtp:  # DeepSeek-V3's MTP loss: the next-n layer at position t predicts token t+2
            m = out.mtp_logits.float()
            self._mtp_loss = F.cross_entropy(m.reshape(-1, m.size(-1)), targets[:, 1:].reshape(-1))
            aux = aux + self.cfg.mtp_loss_weight * self._mtp_loss
        return lm, aux, out.aux

    def _diverged(self, lm_loss: float, aux_loss: float) -> None:
        step = self.step + 1
        where = f"the last good checkpoint is {self.checkpoint}" if self.checkpoint else "no checkpoint was saved yet"
        self.metrics.write({"kind": "error", "step": step, "lm_loss": lm_loss, "aux_loss": aux_loss})
        raise TrainingDiverged(f"loss became non-finite at step {step} (lm {lm_loss}, aux {aux_loss}); "
                               f"stopped without applying it; {where}. Try a lower lr or grad clipping.")

    def _log_train(self, bar) -> None:
        record, warnings = self.tracker.flush(self.step)
        self.metrics.write(record)
        for w in warnings if self.info.is_main else []:
            bar.write(f"WARNING: {w}")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the fixed validation windows (sharded over ranks)."""
        self.model.eval()
        mine = torch.from_numpy(self.val_windows[self.info.rank::self.info.world])
        total = torch.zeros(2, dtype=torch.float64)
        chunks = list(mine.split(self.cfg.batch_size))
        if self.par is not None:  # sharded forwards are collectives: every rank runs as many (some empty)
            most = math.ceil(math.ceil(len(self.val_windows) / self.info.world) / self.cfg.batch_size)
            chunks += [mine[:0]] * (most - len(chunks))
        for chunk in chunks:
            chunk = chunk.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bf16"):
                logits = self.model(chunk[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1), reduction="sum")
            total += torch.tensor([loss.item(), chunk[:, 1:].numel()], dtype=torch.float64)
        total = dist.all_reduce_sum(total, self.info)
        self.model.train()
        return (total[0] / total[1]).item()

    def evaluate_and_log(self) -> float:
        val = self.evaluate()
        self.metrics.write({"kind": "val", "step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        return val

    def save(self) -> Path | None:
        if self.par is not None:
            state = {"step": self.step, "data": self.batcher.state_dict(), "rng": rng_state(),
                     "train_config": self.cfg.to_dict(), "world": self.info.world}
            self.checkpoint = dist_checkpoint.save(self.par, self.model, self.optimizer, self.out, self.step, state,
                                                   self.tokenizer, self.cfg.keep_checkpoints)
            return self.checkpoint
        if self.info.is_main:
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "data": self.batcher.state_dict(),
                     "rng": rng_state(), "tracker": self.tracker.state_dict(), "train_config": self.cfg.to_dict(),
                     "world": self.info.world}
            self.checkpoint = save_checkpoint(self.out, self.step, self.model, state, self.tokenizer,
                                              keep=self.cfg.keep_checkpoints)
        dist.barrier(self.info)
        return self.checkpoint
