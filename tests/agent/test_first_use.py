"""Defects a first user hit in the agent runtime: task records, deliverables, the README example."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from agent_testkit import AgentServer
from testutil import free_port

from openglm.agent import service
from openglm.agent.snapshot import Snapshots
from openglm.agent.store import StateConflict
from openglm.agent.task import ConstraintError, parse_constraints

ROOT = Path(__file__).resolve().parents[2]


def test_cancelling_a_paused_task_records_when_it_finished(store, config, workspace):
    task = service.submit(store, config, "x", str(workspace))
    service.pause(store, task.id)
    done = service.cancel(store, task.id)
    assert done.state == "CANCELLED" and done.finished_at > 0 and done.phase == "cancelled"


def test_phase_follows_the_state_when_queued_again(store, config, workspace):
    task = service.submit(store, config, "x", str(workspace))
    store.update_task(task.id, {"state": "NEEDS_INPUT", "phase": "needs_input", "reason": "which file?"})
    again = service.answer(store, task.id, "a.txt")
    assert again.state == "QUEUED" and again.phase == "queued"
    assert service.pause(store, task.id).phase == "paused"
    assert service.resume(store, task.id).phase == "queued"


def test_pausing_a_paused_task_is_a_no_op_and_a_finished_one_says_why(store, config, workspace):
    task = service.submit(store, config, "x", str(workspace))
    service.pause(store, task.id)
    assert service.pause(store, task.id).state == "PAUSED"  # idempotent, not "expected one of ['QUEUED']"
    service.cancel(store, task.id)
    with pytest.raises(StateConflict, match="is CANCELLED: only a QUEUED or RUNNING task can be paused"):
        service.pause(store, task.id)


def test_rollback_restores_exact_file_modes(tmp_path, workspace):
    key = workspace / "key.pem"
    key.write_text("secret\n")
    os.chmod(key, 0o600)
    tool = workspace / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    os.chmod(tool, 0o700)
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take("step 1")
    key.unlink()
    os.chmod(tool, 0o755)
    (workspace / "new.txt").write_text("n")
    snaps.take("step 2")
    snaps.restore(first)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.read_text() == "secret\n"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o700
    fresh = Snapshots(workspace, tmp_path / "snap.git")  # a new process (worker restart) knows the modes too
    key.unlink()
    fresh.take("step 3")
    fresh.restore(first)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_deliverables_have_an_unambiguous_form():
    c = parse_constraints({"deliverables": ["dist/app.iso", {"path": "README.md"}, {"run": "pytest -q"},
                                            {"command": "make check"}]})
    assert [d.describe() for d in c.deliverables] == ["path dist/app.iso", "path README.md", "run `pytest -q`",
                                                      "run `make check`"]
    for bad in ({"run": ""}, {"path": "a", "run": "b"}, {"exec": "x"}, 3):
        with pytest.raises(ConstraintError, match=r"\{'run': COMMAND\}"):
            parse_constraints({"deliverables": [bad]})


def test_cli_deliverable_adds_to_the_constraints_deliverables(monkeypatch, capsys):
    from openglm.agent import cli

    sent = {}
    client = SimpleNamespace(submit_long_task=lambda objective, constraints, **kw: sent.update(c=constraints) or "t-1")
    monkeypatch.setattr(cli, "_client", lambda args: client)
    from openglm.cli import main

    assert main(["task", "submit", "go", "--constraints", '{"deliverables": [{"run": "pytest -q"}]}',
                 "--deliverable", "out.txt", "--deliverable-run", "make check"]) == 0
    assert sent["c"]["deliverables"] == [{"run": "pytest -q"}, "out.txt", {"run": "make check"}]


def _readme_client_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "submit_long_task" in b)


def test_readme_client_example_succeeds_end_to_end(tmp_path, monkeypatch):
    """The README's GLMClient snippet, as written (default port), against `openglm agent-server --replay
    examples/turns.jsonl` (docs/agent.md's first command): the task reaches SUCCEEDED, `pytest -q` passing."""
    from openglm.client import DEFAULT_URL

    code = _readme_client_block()
    assert DEFAULT_URL.replace("127.0.0.1", "localhost") in code  # one default port: README, client, server
    port = free_port()
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # pytest
    server = AgentServer(tmp_path, port, str(ROOT / "examples" / "turns.jsonl")).wait_ready()
    try:
        scope: dict = {}
        exec(code.replace(DEFAULT_URL.replace("127.0.0.1", "localhost"), server.url), scope)
        final = scope["client"].wait(scope["task_id"], poll=0.2, timeout=60)
        events = scope["client"].get_events(scope["task_id"], limit=1000)
    finally:
        server.stop()
    assert final["state"] == "SUCCEEDED", final
    checks = [e for e in events if e["kind"] == "deliverables"]
    assert checks and checks[-1]["data"]["results"] == [{"deliverable": "run `pytest -q`", "ok": True}]


def test_agent_server_with_a_missing_replay_file_says_so_at_start(tmp_path):
    p = subprocess.run([sys.executable, "-m", "openglm", "agent-server", "--replay", str(tmp_path / "nope.jsonl"),
                        "--data-dir", str(tmp_path / "d"), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode != 0 and "nope.jsonl" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_swe_objective_names_the_workspace(tmp_path):
    from openglm.swe.solve import objective

    text = objective({"repo": "/src/original", "problem_statement": "add() is wrong"}, False, tmp_path / "repo")
    assert text.startswith(f"Resolve this issue in the repository at {tmp_path / 'repo'} ")


def test_restoring_modes_never_follows_a_symlinked_directory_out_of_the_workspace(tmp_path, workspace):
    (workspace / "d").mkdir()
    (workspace / "d" / "key").write_text("k")
    os.chmod(workspace / "d" / "key", 0o600)
    snaps = Snapshots(workspace, tmp_path / "snap.git")
    first = snaps.take("step 1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "key").write_text("not yours")
    os.chmod(outside / "key", 0o644)
    import shutil

    shutil.rmtree(workspace / "d")
    os.symlink(outside, workspace / "d")  # the directory is now a link out of the workspace
    snaps.take("step 2")
    snaps.restore(first)
    assert stat.S_IMODE((outside / "key").stat().st_mode) == 0o644
    assert stat.S_IMODE((workspace / "d" / "key").stat().st_mode) == 0o600 and not (workspace / "d").is_symlink()
