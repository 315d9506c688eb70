"""End to end: `openglm agent-server` driven by `openglm serve` (a random-weight tiny checkpoint,
constrained tool calls). The task runs >= 10 steps, each a real tool call executed in the workspace;
every request the model server received obeys OpenAI's message rules and fits the context; the
agent-server is SIGKILLed mid-task and the restarted one finishes the task."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from glm_e2e_policy import FILE_TOOLS, FILES, FIRST_SUBMIT_STEP
from testutil import free_port, openglm_serve, serve_in_thread, wait_healthy

from openglm.client import GLMClient

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-glm"
CONTEXT = 1536


def _env():
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "agent"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_server(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    ckpt = build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", index_n_heads=16)
    with openglm_serve(ckpt, "--served-model-name", MODEL, "--max-model-len", str(CONTEXT), "--num-kv-blocks",
                       "256", "--threads", "1", "--log-level", "warning", env=_env()) as url:
        yield url


@pytest.fixture(scope="module")
def recorder(model_server):
    """A pass-through proxy in front of the model server that keeps every chat request and status."""
    app, seen = FastAPI(), []
    upstream = httpx.Client(base_url=model_server, timeout=120)

    @app.get("/v1/models")
    def models():
        return upstream.get("/v1/models").json()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        r = upstream.post("/v1/chat/completions", json=body)
        seen.append((body, r.status_code, r.json()))
        return JSONResponse(r.json(), status_code=r.status_code)

    url, stop = serve_in_thread(app)
    yield f"{url}/v1", seen
    stop()


def _agent_server(tmp, port, config):
    return subprocess.Popen([sys.executable, "-m", "openglm", "agent-server", "--port", str(port), "--data-dir",
                             str(tmp / "agent-data"), "--config", str(config), "--workers", "1", "--lease-ttl", "2",
                             "--workspace-root", str(tmp)],
                            env=_env(), cwd=tmp, start_new_session=True)


def check_openai_message_rules(messages: list[dict]) -> None:
    """OpenAI's ordering: each assistant tool call is answered by a tool message right after it,
    before any other message; a tool message answers a call of the assistant message before it."""
    assert messages and messages[0]["role"] in ("system", "user")
    pending: set = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            assert m["tool_call_id"] in pending, f"messages[{i}]: tool reply to no open call"
            pending.discard(m["tool_call_id"])
            continue
        assert not pending, f"messages[{i}] ({m['role']}) comes before the replies to calls {pending}"
        if m["role"] == "assistant":
            for c in m.get("tool_calls") or []:
                assert isinstance(json.loads(c["function"]["arguments"]), dict)
                pending.add(c["id"])
    assert not pending, "the last tool calls have no replies"


def test_agent_server_runs_a_long_task_on_openglm_serve(tmp_path, recorder):
    url, seen = recorder
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"policy": "glm_e2e_policy:make", "model": {
        "base_url": url, "model": MODEL, "tool_choice": "required", "max_tokens": 96, "temperature": 1.0,
        "extra_body": {"parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}}}}))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    port = free_port()
    agent_url = f"http://127.0.0.1:{port}"
    proc = _agent_server(tmp_path, port, config)
    try:
        wait_healthy(agent_url, proc)
        client = GLMClient(agent_url)
        task_id = client.submit_long_task("Keep notes in the files.", {"max_steps": 40}, workspace=str(workspace))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _committed(client, task_id) < 4:
            time.sleep(0.2)
        assert _committed(client, task_id) >= 4
        os.killpg(proc.pid, signal.SIGKILL)  # the agent-server and its worker, mid-task
        proc.wait(10)
        proc = _agent_server(tmp_path, port, config)
        wait_healthy(agent_url, proc)
        status = client.wait(task_id, poll=0.3, timeout=300)
        events = _events(client, task_id)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
    assert status["state"] == "SUCCEEDED", status
    steps = sorted({e["step"] for e in events if e["kind"] == "step_committed" and e["step"] > 0})
    assert len(steps) >= FIRST_SUBMIT_STEP, steps
    names = {t["function"]["name"] for t in FILE_TOOLS} | {"submit"}
    for step in steps:  # every step is a real tool call with its observation
        calls = [e for e in events if e["kind"] == "tool_call" and e["step"] == step]
        observed = [e for e in events if e["kind"] == "observation" and e["step"] == step]
        assert calls and all(c["data"]["name"] in names for c in calls), (step, calls)
        assert len(observed) >= len(calls)
    assert any((workspace / f).is_file() for f in FILES)  # the calls ran in the workspace
    assert any(e["kind"] == "run_started" and e["data"].get("resumed") for e in events)  # resumed after the kill
    assert len(seen) >= len(steps)
    for body, status_code, reply in seen:
        assert status_code == 200, reply  # no context overflow, no rejected request
        assert isinstance(body["max_tokens"], int) and body["tool_choice"] == "required"
        check_openai_message_rules(body["messages"])
        assert reply["choices"][0]["finish_reason"] == "tool_calls"
        assert reply["usage"]["prompt_tokens"] + body["max_tokens"] <= CONTEXT


def _events(client, task_id) -> list[dict]:
    out: list[dict] = []
    while page := client.get_events(task_id, after=out[-1]["seq"] if out else 0, limit=1000):
        out += page
    return out


def _committed(client, task_id) -> int:
    return sum(1 for e in _events(client, task_id) if e["kind"] == "step_committed")
