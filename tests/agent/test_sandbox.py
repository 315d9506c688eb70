"""A task's commands run in the sandbox (openglm/util/sandbox.py), through the real worker: its `bash`
cannot read a canary outside the workspace, write outside it, reach the network (unless the task may),
see the agent's tokens or leave a process behind; a fork bomb, a memory hog, a CPU spin, a huge file and
a full /tmp are contained; the
deliverable command and the SWE policy's checks run inside it; the newcomer example still succeeds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from agent_testkit import AgentServer, call, make_worker, turn, write_script
from testutil import free_port

from openglm.agent import service
from openglm.agent.config import AgentConfig
from openglm.agent.llm import ReplayModel
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker
from openglm.client import GLMClient
from openglm.util.sandbox import SandboxConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=30, poll_interval=0.05,
                         sandbox=SandboxConfig(processes=128, allow_network=True))
    store = SQLiteStore(str(tmp_path / "data" / "agent.db"))
    yield config, store, ws
    store.close()


def run_task(setup, *commands, constraints=None):
    """One task running `commands` as bash steps, then submitting; (final state, observations, task)."""
    config, store, ws = setup
    task = service.submit(store, config, "probe", str(ws), {"command_timeout": "20s", **(constraints or {})})
    turns = [turn(call("bash", command=c)) for c in commands] + [turn(call("submit", summary="done"))]
    state = make_worker(config, store, turns).run_one()
    obs = [e.data for e in store.all_events(task.id) if e.kind == "observation"]
    return state, obs, store.get_task(task.id)


def marked(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += [int(pid)] if marker.encode() in f.read() else []
        except OSError:
            pass
    return found


def test_a_tasks_bash_cannot_read_a_canary_outside_the_workspace(setup, tmp_path):
    config, _, _ = setup
    canary = tmp_path / "canary.txt"
    canary.write_text("CANARY-7f3a")
    state, obs, _ = run_task(setup, f"cat {canary}; cat {config.data_dir}/agent.db | head -c 100; ls /root; id -u")
    assert state == "SUCCEEDED"
    out = obs[0]["output"]
    assert "CANARY-7f3a" not in out and "SQLite" not in out and "No such file" in out
    assert out.split()[-1] == "65534"  # an unprivileged user


def test_a_tasks_bash_cannot_write_outside_the_workspace(setup, tmp_path):
    config, _, ws = setup
    targets = [tmp_path / "escaped.txt", Path(config.data_dir) / "escaped.txt", Path("/etc/escaped-by-a-task")]
    command = "; ".join(f"echo x > {t}" for t in targets) + "; echo inside > ok.txt"
    state, obs, task = run_task(setup, command)
    assert state == "SUCCEEDED" and (ws / "ok.txt").read_text() == "inside\n"
    assert not any(t.exists() for t in targets)
    snapshots = Path(config.task_dir(task.id)) / "snapshots.git" / "config"
    assert snapshots.exists()  # the task's snapshot repository is there, and out of the command's reach:
    state, obs, _ = run_task(setup, f"echo '[core] fsmonitor = /tmp/x' >> {snapshots}")
    assert "fsmonitor" not in snapshots.read_text() and "No such file" in obs[0]["output"]


@pytest.fixture
def listener():
    """A TCP server on the host's loopback that answers "pong" to whoever connects."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"pong")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


def test_a_tasks_bash_cannot_reach_the_network_by_default(setup, listener):
    probe = (f"python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', {listener}), timeout=3); "
             "print(s.recv(4).decode())\" 2>&1 | tail -1")
    _, obs, _ = run_task(setup, probe)
    assert "pong" not in obs[0]["output"] and "Connection refused" in obs[0]["output"]
    _, obs, _ = run_task(setup, probe, constraints={"network": True})  # allowed by this server's sandbox config
    assert obs[0]["output"].split("\n", 1)[1].strip() == "pong"


def test_network_is_refused_at_submit_where_the_server_does_not_allow_it(setup):
    config, store, ws = setup
    config.sandbox.allow_network = False
    with pytest.raises(Exception, match="does not let tasks use the network"):
        service.submit(store, config, "x", str(ws), {"network": True})


def test_a_tasks_bash_cannot_see_the_agents_tokens(setup, monkeypatch):
    monkeypatch.setenv("OPENGLM_AGENT_TOKEN", "agent-token-91c2")
    monkeypatch.setenv("OPENGLM_MODEL_API_KEY", "model-key-52be")
    monkeypatch.setenv("GITHUB_TOKEN", "gh-token-11aa")
    _, obs, _ = run_task(setup, "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; ls /proc | grep -c '^[0-9]'")
    out = obs[0]["output"]
    assert not any(s in out for s in ("agent-token-91c2", "model-key-52be", "gh-token-11aa"))
    assert int(out.split()[-1]) < 10  # its own pid namespace: the server's processes are not there to read


def test_a_tasks_bash_leaves_no_process_after_the_step(setup):
    marker = f"m{uuid.uuid4().hex[:10]}"
    sleeper = f"bash -c 'exec -a {marker} sleep 300'"
    state, obs, _ = run_task(setup, f"setsid {sleeper} & ({sleeper} &); nohup {sleeper} >/dev/null 2>&1 & "
                                    f"sleep 0.3; echo running=$(pgrep -c -f '^{marker}')")
    assert state == "SUCCEEDED" and "running=3" in obs[0]["output"]
    deadline = time.monotonic() + 5
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(marker) == []


def test_a_fork_bomb_is_contained(setup):
    config, _, _ = setup
    config.sandbox.processes = 64
    t0 = time.monotonic()
    state, obs, task = run_task(setup, "bomb() { bomb | bomb & }; bomb; sleep 2; echo after-the-bomb",
                                "echo still-working", constraints={"command_timeout": "8s"})
    assert state == "SUCCEEDED" and time.monotonic() - t0 < 60
    assert obs[1]["output"].split("\n", 1)[1].strip() == "still-working"  # the task goes on afterwards
    limits = [e.data for e in SQLiteStore(config.store_url).all_events(task.id) if e.kind == "run_started"][0]
    assert limits["limits"]["processes_via"] in ("pids cgroup", "RLIMIT_NPROC")
    assert "Resource temporarily unavailable" in obs[0]["output"]  # forks past the limit were refused


def test_a_memory_hog_is_contained(setup):
    hog = "python3 -c \"x = bytearray(3 << 30); print('allocated')\""
    state, obs, _ = run_task(setup, hog, "echo still-working", constraints={"resource": "256MB"})
    assert state == "SUCCEEDED"
    assert not obs[0]["ok"] and "allocated" not in obs[0]["output"]
    assert "MemoryError" in obs[0]["output"] or "memory limit" in obs[0]["output"]
    assert obs[1]["output"].split("\n", 1)[1].strip() == "still-working"


def test_a_cpu_spin_a_huge_file_and_a_full_tmp_are_contained(setup):
    config, _, ws = setup
    config.sandbox.cpu_s, config.sandbox.file_bytes, config.sandbox.tmp_bytes = 1, 1 << 20, 1 << 20
    spin = "python3 -c 'while True: pass'; echo spin=$?"
    big = "head -c 3M /dev/zero > big.bin; echo big=$?; stat -c size=%s big.bin"
    full = "head -c 3M /dev/zero > /tmp/fill 2>&1; echo tmp=$?; stat -c tmpsize=%s /tmp/fill"
    t0 = time.monotonic()
    state, obs, _ = run_task(setup, spin, big, full, "echo still-working", constraints={"command_timeout": "60s"})
    assert state == "SUCCEEDED"
    assert "spin=152" in obs[0]["output"] and time.monotonic() - t0 < 50  # SIGXCPU after 1 CPU second, not the timeout
    assert "big=153" in obs[1]["output"] and "size=1048576" in obs[1]["output"]  # SIGXFSZ at the file-size cap
    assert (ws / "big.bin").stat().st_size == 1 << 20
    tmp = int(obs[2]["output"].split("tmpsize=")[1].split()[0])
    assert "tmp=1" in obs[2]["output"] and tmp <= 1 << 20  # the private /tmp is full at its size
    assert obs[3]["output"].split("\n", 1)[1].strip() == "still-working"


def test_the_deliverable_command_runs_in_the_sandbox(setup, tmp_path):
    config, store, ws = setup
    canary = tmp_path / "canary.txt"
    canary.write_text("x")
    inside = f'test "$(id -u)" = 65534 && test ! -e {canary} && touch delivered'
    task = service.submit(store, config, "deliver", str(ws), {"deliverables": [{"run": inside}]})
    assert make_worker(config, store, [turn(call("submit", summary="done"))]).run_one() == "SUCCEEDED"
    assert (ws / "delivered").exists() and store.get_task(task.id).state == "SUCCEEDED"


def test_the_swe_policys_checks_run_in_the_sandbox(tmp_path):
    from openglm.swe.policy import SWEPolicy, SWEPolicyConfig
    from openglm.util.git import init_repo

    canary = tmp_path / "canary.txt"
    canary.write_text("x")
    ws = tmp_path / "ws"
    (ws / "tests").mkdir(parents=True)
    (ws / "lib.py").write_text("def f():\n    return 1\n")
    (ws / "tests" / "test_lib.py").write_text("from lib import f\n\ndef test_f():\n    assert f() == 2\n")
    init_repo(ws)
    probe = (f"import json, os\n\ndef test_probe():\n    json.dump({{'uid': os.getuid(), 'canary': os.path.exists("
             f"{str(canary)!r})}}, open('probe.json', 'w'))\n    assert False\n")
    turns = [turn(call("phase_done", summary="a pytest project")),
             turn(call("phase_done", summary="f returns 1", failing_tests=["tests/test_lib.py::test_f"])),
             turn(call("regression_test", path="tests/test_probe.py", content=probe,
                       test="tests/test_probe.py::test_probe"))]
    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=30, poll_interval=0.05)
    store = SQLiteStore(str(tmp_path / "agent.db"))
    service.submit(store, config, "tests/test_lib.py::test_f fails", str(ws), {"max_steps": 4})
    Worker(config, store=store, model=ReplayModel(turns), policy_factory=lambda: SWEPolicy(SWEPolicyConfig())).run_one()
    assert json.loads((ws / "probe.json").read_text()) == {"uid": 65534, "canary": False}


def test_the_newcomer_example_calc_still_succeeds(tmp_path):
    ws = tmp_path / "calc"
    shutil.copytree(ROOT / "examples" / "calc", ws)
    script = write_script(tmp_path / "fix.jsonl", [
        turn(call("view", path="calc.py")),
        turn(call("edit", path="calc.py", old="return a - b", new="return a + b")),
        turn(call("bash", command=f"{sys.executable} -m pytest -q")),
        turn(call("submit", summary="add fixed"))])
    server = AgentServer(tmp_path, free_port(), script).wait_ready()
    try:
        client = GLMClient(server.url)
        task_id = client.submit_long_task("make the tests pass", {"deliverables": [{"run": "python -m pytest -q"}]},
                                          workspace=str(ws))
        status = client.wait(task_id, poll=0.2, timeout=120)
    finally:
        server.stop()
    assert status["state"] == "SUCCEEDED", status
    assert "return a + b" in (ws / "calc.py").read_text()


def test_an_unsandboxed_or_refusing_server_says_so_loudly(tmp_path, capsys, monkeypatch):
    from openglm.agent.server import announce_sandbox
    from openglm.util import sandbox

    announce_sandbox(AgentConfig(data_dir=str(tmp_path)), "agent-server")
    assert capsys.readouterr().err == ""  # the sandbox works: nothing to say
    announce_sandbox(AgentConfig(data_dir=str(tmp_path), sandbox=SandboxConfig(enabled=False)), "agent-server")
    assert "--unsafe-no-sandbox: tasks' commands run UNCONFINED" in capsys.readouterr().err
    sandbox.probe.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        announce_sandbox(AgentConfig(data_dir=str(tmp_path)), "worker")
    finally:
        sandbox.probe.cache_clear()
    err = capsys.readouterr().err
    assert "every command they try is refused" in err and "bubblewrap" in err


def test_the_flags_reach_the_config(tmp_path):
    import argparse

    from openglm.agent import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["agent-server", "--data-dir", str(tmp_path), "--unsafe-no-sandbox", "--workspace-root",
                              "/srv/repos", "--public-name", "agent.example.org"])
    config = cli._load_config(args)
    assert not config.sandbox.enabled and config.workspace_roots == ["/srv/repos"]
    assert config.public_names == ["agent.example.org"]
    assert cli._load_config(parser.parse_args(["worker", "--data-dir", str(tmp_path)])).sandbox.enabled
