"""Run under torchrun by test_parallel_serve.py: build the tensor/expert-parallel engine from a deploy.yaml,
generate greedily on rank 0 (the other ranks follow its steps), and save the token ids rank 0 got."""

import sys

import torch

from openglm.deploy.config import load_deploy_config
from openglm.deploy.launch import build_engine
from openglm.engine import SamplingParams
from openglm.engine.model_runner import ModelRunner
from openglm.engine.parallel import exit_rank, follow_steps

PROMPTS = ["def fibonacci(n):", "def fibonacci(n):\n    if n < 2:",
           "import os\n\nclass Stack:\n    def push(self, x):" * 3, "x = 1"]


def generate(engine) -> list[list[int]]:
    """All prompts at once (continuous batching, shared prefixes, chunked prefill), greedy."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


if __name__ == "__main__":
    torch.set_num_threads(1)
    built = build_engine(load_deploy_config(sys.argv[1]))
    if isinstance(built, ModelRunner):
        follow_steps(built)
    else:
        torch.save(generate(built), sys.argv[2])
        built.runner.stop_followers()
    exit_rank()
