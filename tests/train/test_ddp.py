import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from openglm.train.trainer import train

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_process_gloo_matches_single_process_with_same_global_batch(tiny_cfg, tmp_path):
    # one process: 2 micro-batches of 2 accumulated == two ranks with one micro-batch of 2 each
    single = train(tiny_cfg(out_dir=str(tmp_path / "single"), batch_size=2, grad_accum=2, max_steps=4))
    cfg = tiny_cfg(out_dir=str(tmp_path / "ddp"), batch_size=2, grad_accum=1, max_steps=4)
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           json.dumps(cfg.to_dict()), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out)
    for step in range(1, 5):
        assert abs(ddp["losses"][step] - single.losses[step]) < 1e-5, step
    ref = single.model.state_dict()
    for name, value in ddp["state"].items():
        assert torch.allclose(value, ref[name], atol=1e-5), name
    # only rank 0 wrote the run folder: one metrics file, one checkpoint
    assert (tmp_path / "ddp" / "checkpoints" / "step_0000004" / "config.json").is_file()
