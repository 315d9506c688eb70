"""The sandbox module on its own: its settings, what the filesystem inside holds, refusals, the
unsandboxed mode, the environment a command gets, and the kills that end a command (its pid namespace,
its cgroup) returning only once every process of it has exited."""

import os
import time
import uuid

import pytest

from openglm.util import proc
from openglm.util.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxUnavailable,
    kill_cgroup,
    kill_namespace,
    namespace_init,
    probe,
    status,
)


@pytest.fixture
def box(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    sandbox = Sandbox(SandboxConfig(), str(ws))
    yield sandbox
    sandbox.close()


def run(sandbox, command: str) -> proc.Result:
    return proc.run(["bash", "-c", command], cwd=sandbox.workspace, env=sandbox.env(), sandbox=sandbox,
                    merge_stderr=True, timeout=60)


@pytest.mark.parametrize("raw", [{"processes": 0}, {"memory_bytes": -1}, {"file_bytes": "8G"}, {"read_only": "/opt"},
                                 {"network": True}, {"tmp_bytes": True}])
def test_bad_settings_are_refused_naming_them(raw):
    with pytest.raises(ValueError, match="sandbox"):
        SandboxConfig.from_dict(raw)


def test_owner_only_files_of_etc_are_hidden_and_the_root_is_read_only(box):
    hidden = [p for p in ("/etc/shadow", "/etc/gshadow") if os.path.exists(p)]
    r = run(box, "; ".join(f"cat {p} >/dev/null 2>&1 && echo READ {p}" for p in hidden) +
            "; cat /etc/passwd >/dev/null && echo passwd-ok; touch /new 2>/dev/null || echo root-read-only; "
            "touch /tmp/t && echo tmp-ok; df -B1 /tmp | tail -1")
    assert "READ" not in r.stdout and "passwd-ok" in r.stdout and "root-read-only" in r.stdout
    assert "tmp-ok" in r.stdout and int(r.stdout.split()[-5]) <= box.config.tmp_bytes


def test_python_and_openglm_are_there_for_the_checks(box):
    r = run(box, "python -c 'import openglm, sys; print(sys.executable, openglm.__name__)'")
    assert r.ok and r.stdout.split()[-1] == "openglm", r.stdout


def test_the_environment_has_no_secrets_and_its_own_home(box, monkeypatch):
    monkeypatch.setenv("OPENGLM_AGENT_TOKEN", "t-123")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "k-456")
    env = box.env()
    assert env["HOME"] == "/tmp" and not {"OPENGLM_AGENT_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert "GIT_AUTHOR_NAME" in proc.scrubbed_env({"GIT_AUTHOR_NAME": "x", "GIT_CONFIG_KEY_0": "core.a"})
    assert "GIT_CONFIG_KEY_0" in proc.scrubbed_env({"GIT_CONFIG_KEY_0": "core.a"})


def test_a_workspace_holding_system_directories_is_refused(tmp_path):
    sandbox = Sandbox(SandboxConfig(), "/")
    try:
        assert "system directories" in sandbox.refusal()
        with pytest.raises(SandboxUnavailable, match="commands are refused"):
            sandbox.wrap(["true"])
    finally:
        sandbox.close()


def test_unsandboxed_mode_runs_under_the_reaper_and_says_so(tmp_path):
    sandbox = Sandbox(SandboxConfig(enabled=False), str(tmp_path))
    try:
        argv = sandbox.wrap(["true"])
        assert argv[3].endswith("reaper.py") and sandbox.refusal() is None
        assert run(sandbox, "id -u").stdout.strip() == str(os.getuid())  # the server's own user
        assert sandbox.describe()["sandbox"] == "off"
    finally:
        sandbox.close()
    assert status(SandboxConfig(enabled=False)).startswith("off (--unsafe-no-sandbox)")


def test_this_machine_can_build_the_sandbox():
    assert probe() is None and status(SandboxConfig()) == "bwrap"


def marked(marker: str) -> list[int]:
    """Processes whose argv[0] is the marker (the launchers, whose command line holds it too, are not)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += [int(pid)] if f.read().split(b"\0")[0] == marker.encode() else []
        except OSError:
            pass
    return found


def start_escapees(sandbox, marker: str):
    """A command whose marked children left its process group (setsid, a double fork); returns once they run."""
    sleeper = f"bash -c 'exec -a {marker} sleep 300' </dev/null >/dev/null 2>&1"
    command = f"setsid {sleeper} & ({sleeper} &); sleep 300"
    launched = proc.spawn(["bash", "-c", command], cwd=sandbox.workspace, env=sandbox.env(), sandbox=sandbox,
                          stdout=proc.DEVNULL, stderr=proc.DEVNULL)
    deadline = time.monotonic() + 30
    while len(marked(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(marked(marker)) == 2
    return launched


def test_killing_the_namespaces_init_ends_every_process_in_it_before_returning(box):
    marker = f"m{uuid.uuid4().hex[:10]}"
    launched = start_escapees(box, marker)
    try:
        init = namespace_init(launched.pid)
        assert init is not None and init[0] != launched.pid
        kill_namespace(init)
        assert marked(marker) == []  # no waiting: gone when the call returns
        kill_namespace(init)  # an init that is gone (its pid perhaps another process's now) is left alone
    finally:
        proc.kill_group(launched.pid)
        launched.wait()


def test_killing_a_sandbox_cgroup_ends_every_process_in_it_before_returning(tmp_path):
    marker = f"m{uuid.uuid4().hex[:10]}"
    box = Sandbox(SandboxConfig(enabled=False), str(tmp_path))  # the reaper: no pid namespace to do the job
    try:
        assert "pids" in box.cgroups.dirs, "this machine gives no pids cgroup"
        launched = start_escapees(box, marker)
        kill_cgroup(box.cgroups.dirs["pids"])
        assert marked(marker) == []
        launched.wait(10)
    finally:
        box.close()
