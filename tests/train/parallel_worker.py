"""Run under torchrun by test_parallel.py: FSDP2 + expert-parallel training of the tiny config.

argv: config JSON, output file, and optionally a second out_dir. Trains to max_steps (saving every
save_every steps); with a second out_dir, then resumes from the step-2 checkpoint into it and trains to
max_steps again. The process group is this script's, so both runs share it. Rank 0 saves the losses."""

import json
import os
import sys

import torch
import torch.distributed as dist

from openglm.train.config import TrainConfig
from openglm.train.trainer import train

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = TrainConfig(**json.loads(sys.argv[1]))
    full = train(cfg)
    out = {"losses": full.losses, "val_losses": full.val_losses, "checkpoint": str(full.checkpoint)}
    if len(sys.argv) > 3:
        step2 = os.path.join(cfg.out_dir, "checkpoints", "step_0000002")
        resumed = train(cfg.replace(out_dir=sys.argv[3]), resume=step2)
        out.update(resumed_losses=resumed.losses, resumed_checkpoint=str(resumed.checkpoint))
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[2])
    dist.destroy_process_group()
