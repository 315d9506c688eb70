"""Tensor + expert parallel serving under torchrun (gloo): greedy outputs equal one process's, through the
engine (4 processes, tp=4, ep=2: two expert shards, each on two ranks) and through HTTP (2 processes,
`openglm serve --config deploy.yaml`, tp=2, ep=2)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from testutil import free_port

from openglm.deploy.config import load_deploy_config
from openglm.deploy.launch import build_engine
from openglm.engine import EngineConfig, LLMEngine
from openglm.model.parallel import LayoutError

sys.path.insert(0, str(Path(__file__).parent))
from parallel_serve_worker import PROMPTS, generate  # noqa: E402

WORKER = Path(__file__).with_name("parallel_serve_worker.py")
ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
# small step budget and blocks: prefill is chunked and a step mixes prefills with decodes
KNOBS = dict(max_num_batched_tokens=24, block_size=4, num_kv_blocks=128, max_num_seqs=4)


def deploy_yaml(tmp_path, checkpoint, **extra) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"model": str(checkpoint), **KNOBS, **extra}))
    return path


@pytest.fixture(scope="module")
def single_process_ids(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(**KNOBS))
    return generate(engine)


def test_four_ranks_tp4_ep2_greedy_equals_one_process(tiny_checkpoint, tmp_path, single_process_ids):
    config = deploy_yaml(tmp_path, tiny_checkpoint, parallel_config={"tensor_parallel": 4, "expert_parallel": 2,
                                                                      "pipeline_parallel": 1})
    out, logs = tmp_path / "ids.pt", tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           f"--log-dir={logs}", "--redirects=3", str(WORKER), str(config), str(out)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, rank_logs(logs) + proc.stderr[-2000:]
    assert torch.load(out) == single_process_ids


def rank_logs(log_dir: Path) -> str:
    """The end of every rank's own output (torchrun's summary alone hides which call failed)."""
    return "".join(f"--- {path.relative_to(log_dir)}\n{path.read_text(errors='replace')[-1500:]}\n"
                   for path in sorted(log_dir.rglob("*.log")))


def _get(url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_torchrun_serve_config_answers_http_like_one_process(tiny_checkpoint, tmp_path, single_process_ids):
    port = free_port()
    config = deploy_yaml(tmp_path, tiny_checkpoint, port=port, served_model_name="tiny-tp",
                         parallel_config={"tensor_parallel": 2, "expert_parallel": 2})
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "openglm", "serve", "--config", str(config)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)
        tok = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(**KNOBS)).tokenizer
        for prompt, ids in zip(PROMPTS[:2], single_process_ids):
            reply = _get(f"http://127.0.0.1:{port}/v1/completions",
                         {"model": "tiny-tp", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                          "ignore_eos": True})
            assert reply["choices"][0]["text"] == tok.decode(ids)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("parallel, message", [
    ({"tensor_parallel": 3}, "tp=3 does not divide num_attention_heads=4"),
    ({"tensor_parallel": 2, "expert_parallel": 3}, "ep=3 does not divide n_routed_experts=8"),
    ({"tensor_parallel": 2, "pipeline_parallel": 2}, "pipeline parallelism is not implemented"),
    ({"tensor_parallel": 2}, "needs tp=2 processes, this job has 1"),
    ({"tensor_parallel": 2, "sequence_parallel": 2}, "unknown key"),
])
def test_bad_serving_layout_is_refused_before_any_process_group(tiny_checkpoint, tmp_path, parallel, message):
    with pytest.raises(LayoutError, match=message):
        build_engine(load_deploy_config(deploy_yaml(tmp_path, tiny_checkpoint, parallel_config=parallel)))
    assert not torch.distributed.is_initialized()
