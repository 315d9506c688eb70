"""User errors are one line, no traceback; `--debug` shows it; the client has its own error type."""

import subprocess
import sys

import pytest
from testutil import free_port

from openglm.client import GLMClient, GLMClientError, GLMConnectionError


def _openglm(*args):
    return subprocess.run([sys.executable, "-m", "openglm", *args], capture_output=True, text=True, timeout=120)


def test_client_against_a_server_that_is_down_raises_its_own_error():
    client = GLMClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(GLMConnectionError, match="cannot reach the task API .* is `openglm agent-server` running"):
        client.get_task_status("t-1")
    assert issubclass(GLMConnectionError, GLMClientError)


def test_cli_against_a_server_that_is_down_prints_one_line():
    p = _openglm("task", "status", "t-1", "--server", f"http://127.0.0.1:{free_port()}")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "cannot reach the task API" in p.stderr


def test_a_user_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "instances.jsonl")
    p = _openglm("swe-eval", "--instances", missing, "--predictions", "gold")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and missing in p.stderr
    debug = _openglm("--debug", "swe-eval", "--instances", missing, "--predictions", "gold")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_missing_repository_and_a_failing_git_command_are_one_line(tmp_path):
    p = _openglm("repomap", str(tmp_path / "nope"))  # used to print an empty map and exit 0
    assert p.returncode == 2 and "nope is not a directory" in p.stderr and "Traceback" not in p.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    p = _openglm("bisect", str(plain), "--good", "HEAD", "--cmd", "true")
    assert p.returncode == 1 and "not a git repository" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
