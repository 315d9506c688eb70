import json

import pytest

from openglm.train.demo import run_demo


def test_demo_pipeline_on_a_tiny_config(corpus_dir, tokenizer_dir, tmp_path, capsys):
    """The demo's whole path (baseline, before/after, sample, files), on the tiny preset and corpus."""
    out = tmp_path / "demo"
    s = run_demo(str(out), steps=12, progress=False, preset="tiny", data=str(corpus_dir), tokenizer=str(tokenizer_dir),
                 seq_len=32, batch_size=4, eval_windows=4, dtype="fp32", log_every=2)
    printed = capsys.readouterr().out
    assert s["steps"] == 12 and s["val_loss_after"] < s["val_loss_before"]
    assert s["sample"].startswith("def fibonacci(n):") and "def fibonacci(n):" in printed
    assert "unigram baseline" in printed and str(out / "loss.png") in printed
    assert json.loads((out / "summary.json").read_text())["checkpoint"].endswith("step_0000012")
    assert (out / "loss.png").is_file() and (out / "expert_load.png").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and "unigram_loss" in records[0]  # the before-training evaluation


def test_calibration_fits_the_budget_and_restores_the_data_position(tiny_cfg):
    from openglm.train.demo import calibrate_steps
    from openglm.train.trainer import Trainer

    trainer = Trainer(tiny_cfg())
    position = trainer.batcher.state_dict()
    assert calibrate_steps(trainer, seconds=1e-6, cap=500, floor=7) == 7
    assert calibrate_steps(trainer, seconds=1e6, cap=500) == 500
    assert trainer.batcher.state_dict() == position
    assert all(p.grad is None for p in trainer.model.parameters())


class StepClock:
    """A clock that reads the trainer's step: 1 s per step until `busy_from`, then `slow` s per step (the machine
    became busy after calibration)."""

    def __init__(self, slow: float = 3.0, busy_from: int = 5):
        self.trainer, self.slow, self.busy_from = None, slow, busy_from

    def __call__(self) -> float:
        return self.at(self.trainer.step if self.trainer is not None else 0)

    def at(self, step: int) -> float:
        return min(step, self.busy_from) + max(0, step - self.busy_from) * self.slow


def test_retimer_ends_the_schedule_within_the_budget_when_the_machine_becomes_busy(tiny_cfg):
    """Calibrated for 30 steps of 1 s in a 30 s budget, the machine slows to 3 s a step after step 5: the schedule
    is cut to what still fits and runs to its end (warmup + the whole cosine), within the budget. Before, the plan
    stayed at 30 steps (80 s here) and only the 1.5x hard stop cut the schedule mid-way."""
    from openglm.train.demo import Retimer
    from openglm.train.schedule import lr_at
    from openglm.train.telemetry import read_metrics
    from openglm.train.trainer import Trainer

    cfg = tiny_cfg(max_steps=30, warmup_steps=2, eval_every=100, save_every=100, log_every=1)
    trainer = Trainer(cfg)
    clock = StepClock()
    clock.trainer = trainer
    result = trainer.run(replan=Retimer(budget_s=30.0, cap=30, clock=clock))
    assert result.step == trainer.cfg.max_steps < 30  # the schedule ran to its (new) end
    assert clock.at(result.step) <= 30.0  # within the budget
    assert clock.at(result.step + 1) > 30.0 - 3.0  # and it used the budget, not stopped early
    lrs = [r["lr"] for r in read_metrics(trainer.out / "metrics.jsonl") if r.get("kind") == "train"]
    floor = cfg.lr * cfg.min_lr_ratio
    assert lrs[-1] == pytest.approx(lr_at(result.step - 1, cfg.lr, cfg.warmup_steps, result.step, cfg.min_lr_ratio))
    assert lrs[-1] - floor < 0.05 * (cfg.lr - floor)  # the cosine reached its floor


def test_a_longer_schedule_keeps_its_number_of_validations(tiny_cfg):
    """Calibrated on a busy machine for 10 steps with 2 validations, the machine turns out twice as fast: the
    schedule grows to what the budget allows and still validates twice (the demo validated every 6 steps of a
    plan grown from 24 to 91: 15 validations, each eating into the budget)."""
    from openglm.train.demo import Retimer
    from openglm.train.telemetry import read_metrics
    from openglm.train.trainer import Trainer

    cfg = tiny_cfg(max_steps=10, warmup_steps=2, eval_every=5, save_every=100, log_every=1)
    trainer = Trainer(cfg)
    clock = StepClock(slow=1.0)
    clock.trainer = trainer
    result = trainer.run(replan=Retimer(budget_s=20.0, cap=40, clock=lambda: clock() / 2))
    assert result.step == trainer.cfg.max_steps > 30
    vals = [r["step"] for r in read_metrics(trainer.out / "metrics.jsonl") if r.get("kind") == "val"]
    assert len(vals) == 2 and vals[-1] == result.step, vals


def test_retimer_keeps_the_plan_on_a_steady_machine_and_grows_it_on_a_faster_one():
    from openglm.train.demo import Retimer

    t = [0.0]
    steady = Retimer(budget_s=20.0, cap=100, clock=lambda: t[0])
    plans = []
    for step in range(1, 11):
        t[0] += 1.0
        plans.append(steady(step))
    assert plans[0] is None and set(plans[1:]) == {20}  # the first step's one-off costs are not the pace
    t[0] = 0.0
    faster = Retimer(budget_s=20.0, cap=25, clock=lambda: t[0])
    for step in range(1, 6):
        t[0] += 0.5
        plan = faster(step)
    assert plan == 25  # 0.5 s steps would fit 40: capped


def test_loss_plot_draws_the_lm_loss_and_the_other_terms_apart():
    """loss.png used to plot the total (LM + balance + 0.3 x MTP) as "train loss", ~2 nats above validation."""
    from openglm.train.plots import loss_figure

    train = [{"kind": "train", "step": s, "loss": 7.0 - 0.1 * s, "lm_loss": 5.0 - 0.1 * s, "aux_loss": 1.8,
              "balance_loss": 0.0, "mtp_loss": 6.0} for s in (10, 20, 30)]
    val = [{"kind": "val", "step": 0, "val_loss": 6.0, "unigram_loss": 5.5}, {"kind": "val", "step": 30,
                                                                               "val_loss": 2.2}]
    fig = loss_figure(train, val)
    lm, others = fig.axes[:2]
    lines = {line.get_label(): list(line.get_ydata()) for line in lm.get_lines()}
    assert lines["train LM loss"] == pytest.approx([4.0, 3.0, 2.0])
    assert lines["validation LM loss"] == [6.0, 2.2] and "unigram baseline (5.50)" in lines
    assert not any("total" in name or name == "train loss" for name in lines)
    other = {line.get_label(): list(line.get_ydata()) for line in others.get_lines()}
    assert other["MTP loss (token t+2)"] == [6.0] * 3 and other["router balance loss"] == [0.0] * 3
    assert other["added to the LM loss (weighted)"] == [1.8] * 3


DOC_COUNTS = [  # (page, the quote, the model it describes)
    ("docs/training.md", r"model: ([\d.]+)M parameters, 6 layers", "demo"),
    ("docs/training.md", r"small` preset \(([\d.]+)M parameters with its next-n layer", "demo"),
    ("docs/training.md", r"scale: ([\d.]+)M parameters trained", "demo"),
    ("docs/model.md", r"`small` \(([\d.]+)M parameters with its one next-n", "small"),
    ("docs/model.md", r"next-n \(MTP\) layer, ([\d.]+)M without", "small-no-mtp"),
]


@pytest.mark.parametrize("page, quote, model", DOC_COUNTS)
def test_documented_parameter_counts_match_the_presets(page, quote, model):
    """The docs quoted 11.9M for the demo model where the demo prints 13.9M (its next-n layer)."""
    import re
    from pathlib import Path

    from openglm.model import ModelConfig
    from openglm.model.params import parameter_report
    from openglm.train.config import RECIPES

    text = (Path(__file__).resolve().parents[2] / page).read_text()
    found = re.findall(quote, text)
    assert found, f"{page}: no quote matching {quote!r}"
    cfg = {"demo": lambda: ModelConfig.from_preset("small", vocab_size=RECIPES["demo"]["vocab_size"]),
           "small": lambda: ModelConfig.from_preset("small"),
           "small-no-mtp": lambda: ModelConfig.from_preset("small", num_nextn_predict_layers=0)}[model]()
    assert set(found) == {f"{parameter_report(cfg)['total_params'] / 1e6:.1f}"}
