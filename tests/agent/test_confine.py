"""Process repros: a step's commands (setsid children and double forks included) die with the step,
and with a SIGKILLed worker, in the sandbox (bubblewrap's pid namespace) and without it (the reaper
launcher, with and without a cgroup); a stopped command has ended when the tool returns; a resuming
worker ends a left-over command before going on; a pid record from another machine or boot, for a reused
pid, or naming a cgroup that is not a sandbox's, is never acted on."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from openglm.agent.process import kill_leftover_commands, pid_record, running_pidfile
from openglm.agent.tools.shell import run_shell
from openglm.util import proc as procs
from openglm.util import reaper
from openglm.util.proc import start_time
from openglm.util.sandbox import Sandbox, SandboxConfig, is_sandbox_cgroup

MODES = ["sandbox", "reaper-cgroup", "reaper-subreaper"]


@pytest.fixture
def sandbox(request, tmp_path, monkeypatch):
    """The confinement a parametrised test runs its command in."""
    mode = request.param
    monkeypatch.setenv("OPENGLM_CONFINE_CGROUP", "0" if mode == "reaper-subreaper" else "1")
    box = Sandbox(SandboxConfig(enabled=mode == "sandbox"), str(tmp_path))
    yield box
    box.close()


def marked(marker: str) -> list[int]:
    """Processes whose command line carries the marker (the process-table scan)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def wait_gone(marker: str, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return marked(marker)


def escapes(marker: str) -> str:
    """A command whose children try every way out of the process group: setsid, a double fork, nohup.
    Each sleeper carries the marker as its argv[0]; the command prints how many are running."""
    sleeper = f"bash -c 'exec -a {marker} sleep 300'"
    return (f"setsid {sleeper} & ({sleeper} &) ; nohup {sleeper} >/dev/null 2>&1 & (setsid sh -c \"({sleeper} &)\" &) ;"
            f" sleep 0.5; echo running=$(pgrep -c -f '^{marker}')")


@pytest.mark.parametrize("sandbox", MODES, indirect=True)
def test_escaping_children_die_when_the_command_ends(tmp_path, sandbox):
    marker = f"m{uuid.uuid4().hex[:10]}"
    result = run_shell(escapes(marker) + "; echo done", str(tmp_path), sandbox=sandbox)
    assert result.exit_code == 0 and "running=4" in result.output and "done" in result.output
    assert wait_gone(marker) == []


@pytest.mark.parametrize("sandbox", MODES, indirect=True)
def test_escaping_children_die_on_timeout(tmp_path, sandbox):
    marker = f"m{uuid.uuid4().hex[:10]}"
    result = run_shell(escapes(marker) + "; sleep 100", str(tmp_path), timeout=2.5, sandbox=sandbox)
    assert result.killed == "timeout" and result.duration_s < 10 and "running=4" in result.output
    assert wait_gone(marker) == []


def writer(marker: str, out) -> str:
    """A command whose setsid child appends to `out` every 10 ms, with a second marked sleeper; it prints
    "started" once the writer has written."""
    quiet = "</dev/null >/dev/null 2>&1"  # not holding the output pipe: the tool does not wait for them to close it
    return (f"setsid bash -c 'exec -a {marker} bash -c \"while :; do echo x >> {out}; sleep 0.01; done\"' {quiet} & "
            f"(bash -c 'exec -a {marker} sleep 300' {quiet} &); while [ ! -s {out} ]; do sleep 0.01; done; "
            "echo started; sleep 300")


def still_writing(out, settle_s: float = 0.3) -> bool:
    size = out.stat().st_size
    time.sleep(settle_s)
    return out.stat().st_size != size


@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("sandbox", MODES, indirect=True)
def test_a_stopped_command_has_ended_when_the_tool_returns(tmp_path, sandbox, how, monkeypatch):
    """No grace period afterwards: once the step has its result (and may be rolled back), nothing the
    command started runs or writes; the reaper's own cgroup is gone too."""
    marker, out = f"m{uuid.uuid4().hex[:10]}", tmp_path / "ticks"
    launched, spawn = [], procs.spawn
    monkeypatch.setattr(procs, "spawn", lambda *a, **k: launched.append(spawn(*a, **k)) or launched[-1])
    stop = (lambda: False) if how == "timeout" else (lambda: out.exists() and out.stat().st_size > 20)
    result = run_shell(writer(marker, out), str(tmp_path), timeout=4 if how == "timeout" else 120, sandbox=sandbox,
                       should_stop=stop)
    assert result.killed == ("timeout" if how == "timeout" else "cancelled") and "started" in result.output
    assert marked(marker) == []  # at once: no waiting for the kernel to finish the job
    assert not still_writing(out)
    root = reaper.cgroup2_root()
    left = [n for n in os.listdir(root) if n.startswith(f"openglm-step-{launched[-1].pid}-")] if root else []
    assert left == []


def test_a_resuming_worker_ends_a_left_over_sandboxed_command_before_going_on(tmp_path):
    """The record names the sandbox's pid namespace and the task's cgroups: a worker that takes the task over
    kills every process of the command and returns only when none is left (then restores the workspace)."""
    marker, out = f"m{uuid.uuid4().hex[:10]}", tmp_path / "ticks"
    box = Sandbox(SandboxConfig(), str(tmp_path))
    pidfile = running_pidfile(tmp_path)
    done = {}
    runner = threading.Thread(target=lambda: done.update(r=run_shell(writer(marker, out), str(tmp_path), timeout=120,
                                                                     sandbox=box, pidfile=pidfile)))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.stat().st_size > 20) and time.monotonic() < deadline:
            time.sleep(0.05)
        record = json.loads(Path(pidfile).read_text())
        assert record["cgroups"] == sorted(set(box.cgroups.dirs.values())) and record["init"] > 1
        kill_leftover_commands(tmp_path)  # as the next worker would, the command still running
        assert marked(marker) == [] and not still_writing(out)
        assert not os.path.exists(pidfile)
    finally:
        runner.join(30)
        box.close()
    assert done["r"].exit_code != 0


@pytest.mark.parametrize("path", ["/sys/fs/cgroup/pids", "/sys/fs/cgroup/pids/openglm-sandbox-1/..", "/",
                                  "/tmp/openglm-sandbox-1", "/sys/fs/cgroup/memory/user.slice"])
def test_a_pid_record_cannot_name_a_cgroup_that_is_not_a_sandboxs(path):
    assert not is_sandbox_cgroup(path)  # killing every process of such a cgroup would kill the machine's


def test_a_sandboxs_own_cgroups_are_recognised(tmp_path):
    box = Sandbox(SandboxConfig(), str(tmp_path))
    try:
        assert box.cgroups.dirs and all(is_sandbox_cgroup(p) for p in box.cgroups.dirs.values())
    finally:
        box.close()


@pytest.mark.parametrize("enabled", [True, False], ids=["sandbox", "reaper"])
def test_a_sigkilled_workers_commands_die_with_it(tmp_path, enabled):
    """The repro: a grandchild kept writing into the workspace for 8 s after the worker's SIGKILL."""
    marker = f"m{uuid.uuid4().hex[:10]}"
    out = tmp_path / "ticks"
    command = (f"setsid bash -c 'exec -a {marker} bash -c \"while :; do echo x >> {out}; sleep 0.05; done\"' & "
               f"(bash -c 'exec -a {marker} sleep 300' &); sleep 300")
    code = ("import sys; from openglm.agent.tools.shell import run_shell; "
            "from openglm.util.sandbox import Sandbox, SandboxConfig; "
            f"box = Sandbox(SandboxConfig(enabled={enabled}), {str(tmp_path)!r}); "
            f"run_shell({command!r}, {str(tmp_path)!r}, timeout=600, sandbox=box)")
    worker = subprocess.Popen([sys.executable, "-c", code], env={**os.environ})
    deadline = time.monotonic() + 30
    while not (out.exists() and out.stat().st_size > 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(marker), "the command did not start"
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    assert wait_gone(marker) == []
    size = out.stat().st_size
    time.sleep(0.5)
    assert out.stat().st_size == size  # nothing writes into the workspace any more
    # the killed worker's cgroups are empty now, and the next sandbox removes them
    box = Sandbox(SandboxConfig(), str(tmp_path))
    parents = {os.path.dirname(path) for path in box.cgroups.dirs.values()}
    box.close()
    assert not [name for parent in parents for name in os.listdir(parent)
                if name.startswith(f"openglm-sandbox-{worker.pid}-")]


def test_the_launcher_reports_the_commands_exit_status(tmp_path):
    launcher = [sys.executable, "-I", "-S", reaper.__file__, str(os.getpid()), "--"]
    assert subprocess.run(launcher + ["sh", "-c", "exit 7"]).returncode == 7
    assert subprocess.run(launcher + ["sh", "-c", "kill -9 $$"]).returncode == 137


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"], start_new_session=True)


@pytest.mark.parametrize("tamper", ["host", "boot_id", "start", "bare number", "init_start"])
def test_a_foreign_or_stale_pid_record_is_never_signalled(tmp_path, tamper):
    proc = sleeper()
    try:
        # the sleeper stands for both the launcher and the sandbox's init (each checked on its own)
        init = (proc.pid, start_time(proc.pid))
        record = json.loads(pid_record(proc.pid, init=init if tamper != "start" else None))
        if tamper == "bare number":  # the old format: no way to tell whose it is
            text = str(proc.pid)
        else:
            if tamper == "init_start":
                record["start"] += 1
            record[tamper] = record[tamper] + 1 if tamper in ("start", "init_start") else "elsewhere"
            text = json.dumps(record)
        with open(running_pidfile(tmp_path), "w") as f:
            f.write(text)
        kill_leftover_commands(tmp_path)
        time.sleep(0.2)
        assert proc.poll() is None, "a process that the record does not name was signalled"
        assert not os.path.exists(running_pidfile(tmp_path))
    finally:
        proc.kill()
        proc.wait()


def test_this_machines_record_kills_the_leftover_command(tmp_path):
    proc = sleeper()
    with open(running_pidfile(tmp_path), "w") as f:
        f.write(pid_record(proc.pid))
    kill_leftover_commands(tmp_path)
    assert proc.wait(5) != 0
