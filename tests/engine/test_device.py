"""The engine's device option (`EngineConfig.device`, `openglm serve --device`): where the weights, the paged KV
pool and each step's tensors live. On the CPU the plumbing must leave everything as it was; `cuda` without a
CUDA device is one clear line; the tests marked `gpu` run the engine on CUDA (deselected without one, see
tests/conftest.py) and check its greedy output against the model's own."""

import os
import subprocess
import sys

import pytest
import torch
from testutil import kernels_at_every_dispatch

from openglm.engine import LLM, EngineConfig, SamplingParams
from openglm.engine.config import resolve_device
from openglm.model import load_model
from openglm.train.generate import generate_ids

PROMPTS = [[5, 9, 33, 7], list(range(40, 75)), [200, 3, 17, 101, 96, 12, 8, 250, 9]]
NEW_TOKENS = 10


def models_own_greedy(model, prompts) -> list[list[int]]:
    """Greedy continuations from the model's own decode loop (DynamicCache, one prompt at a time)."""
    return [generate_ids(model, p, NEW_TOKENS, temperature=0) for p in prompts]


def engine_greedy(llm: LLM, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_device_names_are_checked():
    with pytest.raises(ValueError, match="EngineConfig.device must be cpu, cuda or cuda:N, got 'tpu'"):
        EngineConfig(device="tpu")
    assert EngineConfig(device="cuda:1").device == "cuda:1"  # the format; availability is checked on use
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_a_cuda_device_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device 'cuda': no CUDA device is available \(torch "):
        resolve_device("cuda")


def test_serve_on_cuda_without_a_cuda_device_exits_with_one_line(tiny_checkpoint):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, on any machine
    proc = subprocess.run([sys.executable, "-m", "openglm", "serve", str(tiny_checkpoint), "--device", "cuda"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("openglm serve: device 'cuda': no CUDA device is available")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cpu_engine_keeps_its_pool_on_the_cpu_and_matches_the_models_greedy(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=64, device="cpu")
    got = engine_greedy(llm, PROMPTS)
    runner = llm.engine.runner
    assert runner.device == torch.device("cpu")
    assert runner.pool.tensors and all(t.device.type == "cpu" for t in runner.pool.tensors.values())
    assert got == models_own_greedy(load_model(str(tiny_checkpoint), dtype=torch.float32), PROMPTS)


def test_engine_with_the_kernels_matches_the_engine_without(tiny_checkpoint, monkeypatch):
    """The engine's steps (padded batches of prefill chunks and decodes over the paged pool) with every dispatch
    point taking the Triton kernels (without CUDA: in Triton's interpreter on the CPU): the same greedy tokens."""
    from openglm.model import gpu

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [[5, 9, 33, 7], list(range(40, 60)), [200, 3, 17, 101, 96, 12, 8, 250, 9]]  # 20 > index_topk = 8
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=False,
              device=device)  # no prefix cache: the second run prefills everything again
    with gpu.pytorch_ops():
        plain = engine_greedy(llm, prompts, 6)
    calls = kernels_at_every_dispatch(monkeypatch)
    # 16 tokens a step: the 20-token prompt is prefilled in two chunks, the second beside the others' decodes
    assert engine_greedy(llm, prompts, 6) == plain
    assert set(calls) == {"experts_forward", "dsa_attention", "gather_attention"}


# ---- on a CUDA device ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_engine_matches_the_models_greedy_on_cuda(tiny_checkpoint):
    if not torch.cuda.is_available():
        raise RuntimeError("this test needs a CUDA device (pytest -m gpu selected it)")
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=64, device="cuda")
    got = engine_greedy(llm, PROMPTS)
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and all(t.is_cuda for t in runner.pool.tensors.values())
    model = load_model(str(tiny_checkpoint), dtype=torch.float32, device="cuda")
    assert got == models_own_greedy(model, PROMPTS)
    assert got == engine_greedy(LLM(str(tiny_checkpoint), num_kv_blocks=64), PROMPTS)  # and the CPU engine's


@pytest.mark.gpu
def test_cuda_server_answers_with_the_kernels(tiny_checkpoint):
    import httpx
    from testutil import openglm_serve

    with openglm_serve(tiny_checkpoint, "--device", "cuda") as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 9, 33, 7], "max_tokens": 8,
                                                       "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
