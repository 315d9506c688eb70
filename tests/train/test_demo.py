import json

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
