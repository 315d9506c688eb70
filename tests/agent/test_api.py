"""The HTTP API, the write-up's client snippet and the CLI against a live agent-server."""

import json
import subprocess
import sys
import time
import types

import httpx
import pytest
from agent_testkit import AgentServer, call, turn, write_script
from testutil import free_port

from openglm.agent.api import check_bind
from openglm.client import GLMClient, GLMClientError

SNIPPET = '''
from glm_client import GLMClient

client = GLMClient("http://localhost:8000")

task_id = client.submit_long_task(
    objective="构建支持中文的Linux桌面环境",
    constraints={
        "timeout": "8h",
        "resource": "16CPU/64GB",
        "deliverables": ["ISO镜像", "安装脚本"]
    }
)

# 异步获取进度
while True:
    status = client.get_task_status(task_id)
    if status['state'] == 'SUCCEEDED':
        break
    time.sleep(60)
'''

DESKTOP_TURNS = [
    turn(call("bash", command="echo 'fake iso' > ISO镜像"), content="building the image"),
    turn(call("create", path="安装脚本", content="#!/bin/sh\necho install\n")),
    turn(call("submit", summary="image and installer ready")),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    srv = AgentServer(tmp, free_port(), write_script(tmp / "desktop.jsonl", DESKTOP_TURNS),  # tests' own tmp_path too
                      extra_args=("--workspace-root", str(tmp_path_factory.getbasetemp()))).wait_ready()
    srv.tmp = tmp
    yield srv
    srv.stop()


def test_write_up_client_snippet_runs_verbatim(server, monkeypatch):
    import openglm.client

    monkeypatch.setitem(sys.modules, "glm_client", openglm.client)
    sleeps = []
    fake_time = types.SimpleNamespace(sleep=lambda s: (sleeps.append(s), time.sleep(0.1)))
    scope = {"time": fake_time}
    exec(SNIPPET.replace("http://localhost:8000", server.url), scope)  # only the address differs
    status = scope["status"]
    assert status["state"] == "SUCCEEDED" and status["constraints"]["resource"] == "16CPU/64GB"
    assert all(s == 60 for s in sleeps)
    ws = status["workspace"]
    assert open(f"{ws}/ISO镜像").read() == "fake iso\n" and open(f"{ws}/安装脚本").read().startswith("#!/bin/sh")
    assert status["recent_events"][-1]["data"]["state"] == "SUCCEEDED"


def test_bad_input_is_422_naming_the_field(server):
    client = GLMClient(server.url)
    for constraints, field in [({"timeout": "8 parsecs"}, "constraints.timeout"),
                               ({"colour": "blue"}, "constraints.colour"),
                               ({"resource": "lots"}, "constraints.resource")]:
        with pytest.raises(GLMClientError) as e:
            client.submit_long_task("x", constraints)
        assert e.value.status_code == 422 and e.value.detail["field"] == field
        assert field.split(".")[-1] in json.dumps(e.value.detail["detail"])
    with pytest.raises(GLMClientError) as e:
        client.submit_long_task("x", workspace="/no/such/dir")
    assert e.value.status_code == 422 and e.value.detail["field"] == "workspace"
    r = httpx.post(server.url + "/v1/tasks", json={"constraints": {}})
    assert r.status_code == 422 and "objective" in r.text
    for model in ({"replay": "x.jsonl", "colour": "blue"}, {"model": "glm"}):  # unknown key; no endpoint
        r = httpx.post(server.url + "/v1/tasks", json={"objective": "x", "model": model})
        assert r.status_code == 422 and r.json()["field"] == "model"
    with pytest.raises(GLMClientError) as e:
        client.get_task_status("t-nope")
    assert e.value.status_code == 404


def test_events_paging_sse_snapshots_rollback_answer(server, tmp_path):
    # per-task replay scripts must lie in the server's replay_dirs (by default: its own script's folder)
    script = write_script(server.tmp / f"s-{tmp_path.name}.jsonl", [
        turn(call("create", path="a.txt", content="one")),
        turn(call("bash", command="echo two > a.txt && echo b > b.txt")),
        turn(call("ask_user", question="keep b.txt?")),
        turn(call("submit", summary="done"))])
    ws = tmp_path / "ws"
    ws.mkdir()
    client = GLMClient(server.url)
    task_id = client._call("POST", "/v1/tasks", json={"objective": "t", "workspace": str(ws),
                                                      "model": {"replay": script}})["task_id"]
    assert client.wait(task_id, poll=0.1, timeout=30)["state"] == "NEEDS_INPUT"
    page1 = client.get_events(task_id, after=0, limit=5)
    page2 = client.get_events(task_id, after=5, limit=5)
    assert [e["seq"] for e in page1 + page2] == list(range(1, 11))
    streamed = []
    client.answer(task_id, "yes")
    for event in client.stream_events(task_id):
        streamed.append(event)
    assert streamed[-1]["kind"] == "state" and streamed[-1]["data"]["state"] == "SUCCEEDED"
    assert [e["seq"] for e in streamed] == list(range(1, len(streamed) + 1))
    snaps = client.snapshots(task_id)
    assert [s["step"] for s in snaps] == [0, 1, 2, 3, 4]
    client.rollback(task_id, 1)
    assert (ws / "a.txt").read_text() == "one" and not (ws / "b.txt").exists()
    with pytest.raises(GLMClientError) as e:
        client.rollback(task_id, 99)
    assert e.value.status_code == 422
    with pytest.raises(GLMClientError) as e:
        client.pause(task_id)  # finished tasks cannot be paused
    assert e.value.status_code == 409


def test_cli_against_the_live_server(server, tmp_path):
    ws = tmp_path / "cli-ws"
    ws.mkdir()
    base = [sys.executable, "-m", "openglm.agent", "task"]

    def run(*args):
        p = subprocess.run(base + list(args) + ["--server", server.url], capture_output=True, text=True, timeout=60)
        return p

    p = run("submit", "desktop via CLI", "--workspace", str(ws), "--timeout", "1h", "--deliverable", "ISO镜像")
    assert p.returncode == 0, p.stderr
    task_id = p.stdout.strip()
    GLMClient(server.url).wait(task_id, poll=0.1, timeout=30)
    status = json.loads(run("status", task_id).stdout)
    assert status["state"] == "SUCCEEDED" and (ws / "ISO镜像").exists()
    lines = run("events", task_id, "--limit", "3").stdout.splitlines()
    assert [json.loads(x)["seq"] for x in lines] == [1, 2, 3]
    rolled = json.loads(run("rollback", task_id, "0", "--yes").stdout)  # an in-place folder: --yes, or it asks
    assert rolled["snapshot"] == status["recent_events"][0]["data"].get(
        "snapshot", json.loads(run("status", task_id).stdout)["snapshot"])
    assert not (ws / "ISO镜像").exists()
    bad = run("submit", "x", "--timeout", "8 parsecs")
    assert bad.returncode == 2 and "constraints.timeout" in bad.stderr
    missing = run("status", "no-such-task")
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr
    not_json = run("submit", "x", "--constraints", "{timeout: 8h}")
    assert not_json.returncode != 0 and "--constraints is not valid JSON" in not_json.stderr


def test_bearer_token_required_off_loopback_and_enforced(tmp_path):
    with pytest.raises(ValueError, match="bearer token"):
        check_bind("0.0.0.0", None)
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "s3cret")
    p = subprocess.run([sys.executable, "-m", "openglm.agent", "agent-server", "--host", "0.0.0.0", "--port",
                        str(free_port()), "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.returncode != 0 and "bearer token" in p.stderr
    srv = AgentServer(tmp_path, free_port(), write_script(tmp_path / "s.jsonl", DESKTOP_TURNS), token="s3cret",
                      workers=0).wait_ready()
    try:
        assert httpx.get(srv.url + "/v1/tasks").status_code == 401
        assert httpx.get(srv.url + "/v1/tasks", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert GLMClient(srv.url, api_key="s3cret").list_tasks() == []
    finally:
        srv.stop()
