"""Run under torchrun by test_ddp.py: train the tiny config data-parallel and save what rank 0 saw."""

import json
import os
import sys

import torch

from openglm.train.config import TrainConfig
from openglm.train.trainer import train

if __name__ == "__main__":
    torch.set_num_threads(1)
    cfg = TrainConfig(**json.loads(sys.argv[1]))
    result = train(cfg)

    if os.environ.get("RANK", "0") == "0":
        torch.save({"losses": result.losses, "state": result.model.state_dict()}, sys.argv[2])
