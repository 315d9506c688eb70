"""FSDP2 + expert-parallel training under torchrun (gloo, 2 and 4 processes) against one process.

One process with the same global batch is the reference: ranks take consecutive slices of each global
batch, so one process's micro-batch of `world * batch_size` (or `grad_accum` of them) sees the same tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openglm.model.parallel import LayoutError
from openglm.train.trainer import train

WORKER = Path(__file__).with_name("parallel_worker.py")
AUX = {"switch_loss_coef": 0.01, "z_loss_coef": 0.001, "cv_loss_coef": 0.01}  # exercise the global balance losses


def launch(n: int, cfg, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(WORKER),
           json.dumps(cfg.to_dict()), str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def assert_same_losses(got: dict, ref: dict, rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert abs(got[step] - ref[step]) <= rel * abs(ref[step]), (step, got[step], ref[step])


def assert_same_export(ckpt: Path, ref_ckpt: Path, atol: float = 1e-4) -> None:
    """Same files, same tensor names and shapes, same values up to fp32 reduction order: AdamW divides by
    sqrt(v), so a gradient summed in another order moves a weight by up to ~lr * 1e-3 (measured: 9e-6)."""

    def names(d: Path) -> list[str]:
        return sorted(p.name for p in d.iterdir() if p.is_file() and p.name != "trainer_state.pt")

    assert names(ckpt) == names(ref_ckpt)
    assert json.loads((ckpt / "config.json").read_text()) == json.loads((ref_ckpt / "config.json").read_text())
    got, ref = load_file(ckpt / "model.safetensors"), load_file(ref_ckpt / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for name, value in ref.items():
        assert got[name].shape == value.shape, name
        assert torch.allclose(got[name], value, atol=atol, rtol=1e-4), name


def test_ep_fsdp_two_processes_match_one_and_resume_exactly(tiny_cfg, tmp_path):
    common = dict(max_steps=4, model_overrides=AUX, save_every=2, eval_every=2)
    single = train(tiny_cfg(out_dir=str(tmp_path / "single"), batch_size=4, **common))
    cfg = tiny_cfg(out_dir=str(tmp_path / "ep"), batch_size=2, parallel="dp=2,ep=2", **common)
    par = launch(2, cfg, tmp_path / "ep.pt", str(tmp_path / "resumed"))
    assert_same_losses(par["losses"], single.losses)
    assert_same_losses(par["val_losses"], single.val_losses)
    ckpt = Path(par["checkpoint"])
    assert_same_export(ckpt, single.checkpoint)
    assert (ckpt / "distributed" / ".metadata").is_file()
    # a fresh Trainer resumed from the step-2 distributed checkpoint repeats steps 3-4 bit for bit
    assert par["resumed_losses"] == {3: par["losses"][3], 4: par["losses"][4]}
    assert_same_export(Path(par["resumed_checkpoint"]), ckpt, atol=0.0)


def test_four_processes_two_expert_groups_with_capacity_match_one(tiny_cfg, tmp_path):
    # Capacity is applied per expert group's batch, as one process applies it per micro-batch: two
    # micro-batches of 2 x 2 sequences are the two groups' batches.
    over = {"capacity_factor": 1.0}
    single = train(tiny_cfg(out_dir=str(tmp_path / "single"), batch_size=4, grad_accum=2, max_steps=3,
                            model_overrides=over))
    cfg = tiny_cfg(out_dir=str(tmp_path / "ep"), batch_size=2, max_steps=3, model_overrides=over,
                   parallel="dp=4,ep=2")
    par = launch(4, cfg, tmp_path / "ep.pt")
    assert_same_losses(par["losses"], single.losses)
    assert_same_export(Path(par["checkpoint"]), single.checkpoint)


@pytest.mark.parametrize("layout, world, message", [
    ("dp=2,ep=3", 2, "ep=3 does not divide n_routed_experts=8"),
    ("dp=4,ep=8", 4, "ep=8 must divide dp=4"),
    ("dp=2,ep=2", 1, "needs dp=2 processes, this job has 1"),
    ("dp=2,tp=2", 2, "tensor and pipeline parallel training are not implemented"),
    ("dp=2,xp=2", 2, "expected KEY=N items"),
])
def test_bad_training_layout_is_refused_before_any_process_group(tiny_cfg, tmp_path, monkeypatch, layout, world,
                                                                   message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(LayoutError, match=message):
        train(tiny_cfg(out_dir=str(tmp_path / "bad"), parallel=layout))
    assert not torch.distributed.is_initialized()


def test_cli_reports_a_bad_layout_in_one_line(tmp_path, corpus_dir, tokenizer_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "openglm", "train", "--preset", "tiny", "--data", str(corpus_dir),
                           "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "r"), "--parallel", "dp=1,ep=3"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: layout dp=1,ep=3,tp=1,pp=1: ep=3 does not divide "
                                                "n_routed_experts=8"]
