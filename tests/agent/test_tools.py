import os
import time

import pytest

from openglm.agent.tools import ToolBox
from openglm.agent.tools.files import PathEscape, confine
from openglm.agent.tools.shell import run_shell
from openglm.util.proc import scrubbed_env
from openglm.util.sandbox import Sandbox, SandboxConfig


def test_shell_runs_in_workspace_with_exit_code(workspace):
    r = run_shell("pwd; echo err >&2; exit 3", str(workspace))
    assert r.exit_code == 3 and str(workspace) in r.output and "err" in r.output


def test_shell_timeout_kills_the_whole_process_group(workspace):
    marker = workspace / "still-alive"
    t0 = time.monotonic()
    r = run_shell(f"(sleep 1.5; touch {marker}) & sleep 30", str(workspace), timeout=0.3)
    assert r.timed_out and r.killed == "timeout" and r.exit_code is None
    assert time.monotonic() - t0 < 5
    time.sleep(1.8)
    assert not marker.exists()  # the background child died with the group


def test_shell_output_keeps_head_and_tail(workspace):
    r = run_shell("seq 1 100000", str(workspace), max_output=1000)
    assert r.output.startswith("1\n2\n") and r.output.rstrip().endswith("100000")
    assert "bytes omitted" in r.output and len(r.output) < 2200


def test_secrets_are_scrubbed(monkeypatch, workspace):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("MY_TOKEN", "tok")
    monkeypatch.setenv("DB_PASSWORD", "pw")
    monkeypatch.setenv("HARMLESS", "yes")
    env = scrubbed_env()
    assert "HARMLESS" in env and not {"OPENAI_API_KEY", "MY_TOKEN", "DB_PASSWORD"} & set(env)
    out = run_shell("env", str(workspace)).output
    assert "sk-secret" not in out and "tok" not in out.split("HARMLESS")[0] and "HARMLESS=yes" in out


def test_cancel_stops_a_running_command(workspace):
    t0 = time.monotonic()
    r = run_shell("sleep 30", str(workspace), should_stop=lambda: time.monotonic() - t0 > 0.2)
    assert r.killed == "cancelled" and time.monotonic() - t0 < 5


def test_resource_limits_cpu_affinity_and_memory(workspace):
    sandbox = Sandbox(SandboxConfig(), str(workspace), cpus=1, memory_bytes=300 * 2**20)
    try:
        assert sandbox.describe()["memory_via"] in ("memory cgroup", "RLIMIT_AS + watchdog")
        r = run_shell("python3 -c 'import os; print(len(os.sched_getaffinity(0)))'", str(workspace), sandbox=sandbox)
        assert r.output.split()[-1] == "1"
        r = run_shell("python3 -c 'x = bytearray(800 * 2**20); print(\"allocated\")'", str(workspace),
                      sandbox=sandbox)
        assert r.exit_code != 0 and "allocated" not in r.output
    finally:
        sandbox.close()


def test_file_tools_and_confinement(workspace, tmp_path):
    box = ToolBox(str(workspace))
    assert box.call("create", {"path": "src/a.py", "content": "x = 1\ny = 2\n"}).ok
    assert not box.call("create", {"path": "src/a.py", "content": "again"}).ok
    assert box.call("edit", {"path": "src/a.py", "old": "y = 2", "new": "y = 3"}).ok
    assert (workspace / "src/a.py").read_text() == "x = 1\ny = 3\n"
    assert not box.call("edit", {"path": "src/a.py", "old": "nothing", "new": ""}).ok
    assert "2\ty = 3" in box.call("view", {"path": "src/a.py"}).output
    assert "a.py" in box.call("view", {"path": "src"}).output
    assert "src/a.py:2:y = 3" in box.call("search", {"pattern": "y = \\d"}).output

    secret = tmp_path / "outside.txt"
    secret.write_text("secret")
    os.symlink(secret, workspace / "escape")
    os.symlink(tmp_path, workspace / "escape_dir")
    for name, args in [("view", {"path": "../outside.txt"}), ("view", {"path": "/etc/passwd"}),
                       ("view", {"path": "escape"}), ("create", {"path": "escape_dir/new.txt", "content": "x"}),
                       ("edit", {"path": "escape", "old": "secret", "new": "pwned"}),
                       ("search", {"pattern": "secret", "path": "escape_dir"})]:
        r = box.call(name, args)
        assert not r.ok and r.meta.get("refused"), (name, args, r.output)
    assert secret.read_text() == "secret" and not (tmp_path / "new.txt").exists()
    with pytest.raises(PathEscape):
        confine(workspace, "a/../../x")


def test_tool_mistakes_are_observations_not_crashes(workspace):
    box = ToolBox(str(workspace))
    assert "missing argument" in box.call("bash", {}).output
    assert "unknown tool" in box.call("rm_rf", {}).output
