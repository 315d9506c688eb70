"""`openglm doctor`: each finding comes from a crafted case and is absent from a healthy one.

The crafted runs come from examples/doctor/make_cases.py (the script docs/doctor.md runs): an imbalanced run's
telemetry (an expert at 95% of its layer's tokens, two dead ones, a loss and a gradient-norm spike) with a
checkpoint whose ChatML template its GLM tokenizer cannot spell, and a healthy twin.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from openglm.cli import main
from openglm.doctor.checkpoint import check_checkpoint
from openglm.doctor.diagnose import diagnose
from openglm.doctor.machine import check_machine, check_memory, probe
from openglm.doctor.run import check_run
from openglm.doctor.server import check_server

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def problems(checks) -> dict[str, str]:
    return {c.id: c.level for c in checks if c.level in ("warn", "error")}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_cases", ROOT / "examples" / "doctor" / "make_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("cases")
    return {name: module.make_run(out / name, sick=name == "sick") for name in ("healthy", "sick")}


@pytest.fixture(scope="module")
def facts():
    """This machine, without compiling the kernels (the compiler checks below look at the compiler alone)."""
    return probe(build_kernels=False)


def test_an_imbalanced_runs_telemetry_is_diagnosed(cases):
    found = {c.id: c for c in check_run(cases["sick"])}
    assert problems(found.values()) == {"run.expert_load": "warn", "run.dead_experts": "warn",
                                        "run.loss_spikes": "warn", "run.grad_norm": "warn"}
    assert found["run.expert_load"].data["hot"] == [(1, 3)] and found["run.expert_load"].data["max_share"] > 0.9
    assert found["run.dead_experts"].data["dead"] == [(1, 5), (1, 6)]
    assert "capacity_factor" in found["run.expert_load"].fix and "router_grad_norm" in found["run.expert_load"].fix
    assert [s for s, _ in found["run.loss_spikes"].data["spikes"]] == [250]
    assert [s for s, _ in found["run.grad_norm"].data["spikes"]] == [250]


def test_a_balanced_runs_telemetry_has_no_finding(cases):
    checks = check_run(cases["healthy"])
    assert not problems(checks) and {c.id for c in checks} >= {"run.expert_load", "run.dead_experts",
                                                               "run.loss_spikes", "run.grad_norm", "run.validation"}


def test_a_diverged_run_and_a_run_that_learned_nothing(tmp_path):
    records = [{"kind": "val", "step": 0, "val_loss": 6.0, "unigram_loss": 5.0},
               {"kind": "train", "step": 10, "loss": 6.0, "lm_loss": 6.0, "grad_norm": 1.0},
               {"kind": "val", "step": 10, "val_loss": 5.5},
               {"kind": "error", "step": 11, "lm_loss": float("nan"), "aux_loss": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert problems(check_run(tmp_path)) == {"run.diverged": "error", "run.validation": "warn"}


def test_a_checkpoint_whose_template_and_tokenizer_disagree(cases):
    sick, _ = check_checkpoint(cases["sick"] / "checkpoints" / "step_0000400")
    template = next(c for c in sick if c.id == "checkpoint.template")
    assert template.level == "error" and template.data["missing"] == ["<|im_end|>", "<|im_start|>"]
    healthy, cfg = check_checkpoint(cases["healthy"] / "checkpoints" / "step_0000400")
    assert not problems(healthy) and cfg.num_hidden_layers == 3


def test_what_serve_would_refuse_is_an_error_naming_it(cases, tmp_path):
    import shutil

    src = cases["healthy"] / "checkpoints" / "step_0000400"
    bare = shutil.copytree(src, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    found = {c.id: c for c in check_checkpoint(bare)[0]}
    assert found["checkpoint.tokenizer"].level == "error" and "--tokenizer" in found["checkpoint.tokenizer"].message
    assert not problems(check_checkpoint(bare, tokenizer=str(src))[0])
    small = shutil.copytree(src, tmp_path / "small")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 300, "eos_token_id": 2, "pad_token_id": 0,
                                                   "bos_token_id": 1}))
    found = problems(check_checkpoint(small)[0])
    assert found["checkpoint.weights"] == "error" and found["checkpoint.vocab"] == "error"
    (small / "config.json").write_text(json.dumps({**config, "openglm": {**config["openglm"], "attn_query_chunk": -4}}))
    assert problems(check_checkpoint(small)[0]) == {"checkpoint.config": "error"}


def test_a_machine_without_a_compiler(facts, monkeypatch, capsys):
    found = {c.id: c for c in check_machine(replace(facts, compiler=None, cc_name="cc"))}
    assert found["machine.compiler"].level == "warn" and "apt-get install gcc" in found["machine.compiler"].fix
    if facts.compiler is not None:  # this machine has one: no finding
        assert {c.id: c.level for c in check_machine(facts)}["machine.compiler"] == "ok"
    monkeypatch.setenv("CC", "/nonexistent/openglm-test-cc")
    assert main(["doctor", "--json"]) == 0
    checks = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["machine.compiler"]["level"] == "warn" and "/nonexistent/openglm-test-cc" in \
        checks["machine.compiler"]["message"]


def test_threads_beyond_the_cores(facts):
    assert problems(check_machine(replace(facts, threads=8, cores=2, load=0.0)))["machine.threads"] == "warn"
    assert "machine.threads" not in problems(check_machine(replace(facts, threads=2, cores=2, load=0.0)))


def test_a_model_too_big_for_the_memory(facts, cases, tmp_path):
    """A checkpoint with GLM-5's shape on this machine, and the tiny one."""
    import shutil

    from openglm.model import ModelConfig

    big = shutil.copytree(cases["healthy"] / "checkpoints" / "step_0000400", tmp_path / "glm5")
    (big / "config.json").write_text(json.dumps(ModelConfig.from_preset("glm-5").to_hf_dict()))
    machine = replace(facts, memory_available=64 * GIB, memory_total=64 * GIB)
    memory = next(c for c in diagnose(str(big), machine=machine).checks if c.id == "machine.memory")
    assert memory.level == "error" and memory.data["params"] > 7e11
    tiny = diagnose(str(cases["healthy"]), machine=machine)
    assert next(c for c in tiny.checks if c.id == "machine.memory").level == "ok"
    assert check_memory(10**10, 30 * GIB, 32 * GIB).level == "warn"  # 40 GB fp32, 20 GB bf16: --dtype bf16


def test_cli_json_and_exit_status(cases, capsys):
    assert main(["doctor", str(cases["sick"]), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == {"kind": "run", "path": str(cases["sick"])} and report["counts"]["error"] == 1
    assert main(["doctor", str(cases["healthy"])]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"openglm doctor: run {cases['healthy']}") and "chat template" in text


# ---- servers ----------------------------------------------------------------------------------------------

SERVE_SICK = """openglm_kv_blocks_used 98
openglm_kv_blocks_total 100
openglm_requests_running 8
openglm_requests_waiting 4
openglm_preemptions 3
# TYPE openglm_request_errors counter
openglm_request_errors_total{status="500"} 2
"""
SERVE_HEALTHY = """openglm_kv_blocks_used 10
openglm_kv_blocks_total 100
openglm_requests_running 2
openglm_requests_waiting 0
openglm_preemptions 0
"""
AGENT_LEAKING = """# TYPE openglm_task_rss_growth_long_bytes_per_second gauge
openglm_task_rss_growth_long_bytes_per_second{task="t-1"} 2e6
openglm_task_rss_growth_long_bytes_per_second{task="t-2"} 10
"""
AGENT_HEALTHY = """# TYPE openglm_task_rss_growth_long_bytes_per_second gauge
openglm_task_rss_growth_long_bytes_per_second{task="t-2"} 10
"""


@pytest.fixture
def stub():
    """A server answering /health and /metrics with canned bodies: stub(health_status, health_json, metrics_text)."""
    servers = []

    def start(status: int, health: dict, metrics: str) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                code, body = (status, json.dumps(health)) if self.path == "/health" else (200, metrics)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body.encode())))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def test_a_server_short_of_kv_blocks(stub):
    sick = problems(check_server(stub(200, {"status": "ok"}, SERVE_SICK), watch_s=0))
    assert sick == {"server.kv": "warn", "server.queue": "warn", "server.preemptions": "warn", "server.errors": "warn"}
    assert not problems(check_server(stub(200, {"status": "ok"}, SERVE_HEALTHY), watch_s=0))


def test_an_agent_server_with_a_lost_store_and_a_leaking_task(stub):
    body = {"ok": False, "store": "database file replaced", "workers_alive": 0}
    sick = check_server(stub(503, body, AGENT_LEAKING), watch_s=0)
    assert problems(sick) == {"server.health": "error", "server.store": "error", "server.workers": "error",
                              "server.leak": "warn"}
    assert next(c for c in sick if c.id == "server.leak").data["tasks"] == [("t-1", 2e6)]
    healthy = check_server(stub(200, {"ok": True, "store": "ok", "workers_alive": 2}, AGENT_HEALTHY), watch_s=0)
    assert not problems(healthy)


def test_a_server_that_is_down_is_one_error(tmp_path):
    from testutil import free_port

    checks = check_server(f"http://127.0.0.1:{free_port()}", watch_s=0, timeout=1)
    assert [(c.id, c.level) for c in checks] == [("server.health", "error")]


def test_a_real_openglm_server_is_healthy(cases):
    """Against the real app: the metric names the checks read are the server's own."""
    from testutil import serve_in_thread

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.server.app import create_app

    engine = LLMEngine.from_pretrained(cases["healthy"], EngineConfig(num_kv_blocks=32))
    url, stop = serve_in_thread(create_app(engine, "tiny", public_metrics=True))
    try:
        checks = check_server(url, watch_s=1.0)
    finally:
        stop()
    ids = {c.id: c.level for c in checks}
    assert not problems(checks) and ids["server.kv"] == "ok" and ids["server.queue"] == "ok"
    assert ids.get("server.leak", ids.get("server.process")) in ("ok", "info")
