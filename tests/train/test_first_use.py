"""Defects a first user hit in training: the tiny preset, resume curves, crash-safe saves."""

import json
import os

import pytest

from openglm.model.checkpoint import resolve_checkpoint
from openglm.train.checkpoint import save_checkpoint
from openglm.train.trainer import train


def _train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    keep = ("step", "loss", "lm_loss", "aux_loss", "grad_norm", "expert_counts", "warnings")
    return [{k: r.get(k) for k in keep} for r in map(json.loads, lines) if r["kind"] == "train"]


def _close(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["warnings"] == y["warnings"], x["step"]
        assert x["expert_counts"] == y["expert_counts"], x["step"]
        for k in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k)


def test_resume_after_time_budget_between_log_points_logs_the_same_curve(tiny_cfg, tmp_path):
    # collapse_share=0 makes every used expert "hot", so the detector's streaks decide when warnings fire
    common = dict(max_steps=7, log_every=3, save_every=100, eval_every=100, collapse_share=0.0, collapse_patience=2)
    full = tmp_path / "full"
    train(tiny_cfg(out_dir=str(full), **common))
    part = tmp_path / "part"
    first = train(tiny_cfg(out_dir=str(part), time_budget_s=1e-9, **common))  # stops after step 1
    assert first.step == 1
    mid = train(tiny_cfg(out_dir=str(part), **common), resume=True, stop_at=4)  # 4: not a multiple of 3
    assert mid.step == 4
    train(tiny_cfg(out_dir=str(part), **common), resume=True)
    expected = _train_records(full)
    assert any(r["warnings"] for r in expected)  # the detector state matters for this curve
    _close(_train_records(part), expected)


def test_tiny_preset_trains_from_the_cli(tmp_path, corpus_dir):
    from openglm.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "2", "--out", str(out), "--data", str(corpus_dir),
                 "--seq-len", "32", "--batch-size", "2", "--no-progress", "--no-plots", "--threads", "1"]) == 0
    assert resolve_checkpoint(out).name == "step_0000002"


def _model():
    """A one-layer tiny model (what a checkpoint holds does not matter here)."""
    from openglm.model import GlmMoeDsaForCausalLM, ModelConfig

    return GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", num_hidden_layers=1, indexer_types=["full"]))


def test_kill_between_the_renames_of_a_resave_leaves_a_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(tmp_path, 5, _model(), {"step": 5})
    real_replace = os.replace

    def killed_after_moving_the_old_copy(src, dst):
        real_replace(src, dst)
        if str(src) == str(root / "step_0000005"):
            raise SystemExit("SIGKILL")  # dies here: the old copy moved away, the new one not yet in place

    monkeypatch.setattr(os, "replace", killed_after_moving_the_old_copy)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 5, _model(), {"step": 5})
    monkeypatch.undo()
    assert not (root / "step_0000005").exists()  # the window the kill hit
    assert resolve_checkpoint(tmp_path) == root / "step_0000005"  # recovered, not "nothing at the path"
    assert (root / "step_0000005" / "model.safetensors").is_file()


def test_leftover_temp_folders_are_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("..tmp-step_0000003-abc.tmp-x", ".tmp-step_0000003-y", ".step_0000003.tmp-z", ".old-step_0000002-1"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"w")
    save_checkpoint(tmp_path, 4, _model(), {"step": 4})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004"]


def test_demo_budget_comes_from_the_environment(monkeypatch):
    from openglm.cli import build_parser

    monkeypatch.setenv("OPENGLM_DEMO_BUDGET_S", "30")
    assert build_parser().parse_args(["demo"]).train_seconds == 30.0  # what .ci/run sets
    assert build_parser().parse_args(["demo", "--budget-s", "12"]).train_seconds == 12.0
    monkeypatch.delenv("OPENGLM_DEMO_BUDGET_S")
    assert build_parser().parse_args(["demo"]).train_seconds is None  # then the 240 s default
