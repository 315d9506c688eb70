"""Running commands, one way: every subprocess openglm starts on a user's behalf (the agent's tools, the
SWE harness, verify, bisect, test runs, git) starts in `spawn`, in a session of its own, so that a
timeout or a cancel kills the command's whole process group and not only its first process.

`spawn` is the one place a command starts: given a `sandbox` (`openglm.util.sandbox.Sandbox`: a task's
commands), it wraps `argv` in the sandbox's launcher and adds the sandbox's limits to the child. `run` is
spawn + wait with a timeout + the output. `kill_group`, `stop_group` and `kill_tree` are the process-tree
kills. `scrubbed_env` is the environment a process that needs no secrets gets (a task's commands, git).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

import psutil

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL

_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH(?!OR)|COOKIE|SESSION|PRIVATE", re.I)
_SECRET_PREFIXES = ("AWS_", "AZURE_", "GCP_", "GOOGLE_", "OPENAI_", "ANTHROPIC_", "HF_", "HUGGING", "GITHUB_",
                    "OPENGLM_")


def is_secret(name: str) -> bool:
    """Whether an environment variable's name says it may hold a credential (keys, tokens, passwords,
    cloud and model-provider settings, and every OPENGLM_ variable: the agent's token, the model key).
    Git's own GIT_CONFIG_KEY_<n> (config passed in the environment) is not one."""
    if name.startswith("GIT_CONFIG_"):
        return False
    return bool(_SECRET.search(name)) or name.upper().startswith(_SECRET_PREFIXES)


def scrubbed_env(env: dict | None = None, extra: dict | None = None) -> dict:
    """`env` (default: this process's environment) without any variable that may hold a secret, plus
    `extra` (added after scrubbing: a caller may pass what it knows the command needs)."""
    base = os.environ if env is None else env
    out = {k: v for k, v in base.items() if not is_secret(k)}
    out.update(extra or {})
    return out


@dataclass
class Result:
    """A finished command. `returncode` is None when the timeout killed it (`timed_out`)."""

    argv: list[str]
    returncode: int | None
    stdout: str | bytes
    stderr: str | bytes
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def spawn(argv, *, cwd=None, env: dict | None = None, stdin=None, stdout=None, stderr=None,
          preexec_fn=None, sandbox=None) -> subprocess.Popen:
    """Start `argv` as the leader of a new session (its pid is its process group's id); in `sandbox`
    when one is given (its `wrap` gives the launcher's argv, its `preexec` limits the child)."""
    argv = [os.fspath(a) for a in argv]
    if sandbox is not None:
        argv = sandbox.wrap(argv, cwd=os.fspath(cwd) if cwd is not None else None)
        preexec_fn = _chain(sandbox.preexec, preexec_fn)
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=True, preexec_fn=preexec_fn)


def _chain(first, then):
    if then is None:
        return first

    def both():
        then()  # the caller's own set-up (e.g. die with the parent) before the sandbox's limits
        first()

    return both


def run(argv, *, cwd=None, env: dict | None = None, input: str | bytes | None = None,
        timeout: float | None = None, text: bool = True, merge_stderr: bool = False, sandbox=None) -> Result:
    """Run `argv` to the end, or until `timeout` seconds have passed: then its whole process group is
    killed and what it printed so far is returned with `timed_out`. stdin is `input` (else empty, so a
    command that asks a question fails instead of waiting). With `text`, output is decoded as UTF-8
    (undecodable bytes replaced: a command's output is never trusted to be clean). `sandbox`: as in spawn."""
    data = input.encode() if isinstance(input, str) else input
    start = time.monotonic()
    proc = spawn(argv, cwd=cwd, env=env, stdin=PIPE if data is not None else DEVNULL, stdout=PIPE,
                 stderr=STDOUT if merge_stderr else PIPE, sandbox=sandbox)
    timed_out = False
    try:
        out, err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        out, err = _drain(proc)
    finally:
        if proc.poll() is None:  # an exception in communicate (KeyboardInterrupt): leave nothing behind
            kill_group(proc.pid)
            proc.wait()
    out, err = out or b"", err or b""
    if text:
        out, err = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    return Result([os.fspath(a) for a in argv], None if timed_out else proc.returncode, out, err, timed_out,
                  time.monotonic() - start)


def _drain(proc: subprocess.Popen, grace_s: float = 5.0) -> tuple[bytes, bytes]:
    """The output of a killed group; a process that left the group and still holds the pipe is not
    waited for past `grace_s`."""
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired as e:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()
        return e.stdout or b"", e.stderr or b""


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; a group that is already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name ([] once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        return int(_stat(pid)[19])
    except (ValueError, IndexError):
        return None


def exited(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (it has done all it will do)."""
    fields = _stat(pid)
    return not fields or fields[0] in ("Z", "X")


def stop_group(pgid: int, grace_s: float = 2.0) -> None:
    """SIGTERM the group's leader (a launcher that kills its own tree when told to), give it `grace_s`
    to do so, then SIGKILL the whole group."""
    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not exited(pgid):
        time.sleep(0.02)
    kill_group(pgid)


def tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (those that started a session of their own too)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_tree(pid: int, timeout_s: float = 3.0) -> list[int]:
    """SIGTERM a process tree, then SIGKILL what is left after `timeout_s`. Returns the pids."""
    procs = tree(pid)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    return [p.pid for p in procs]
