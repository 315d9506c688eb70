"""The shell tool: one bash command in the workspace, in its own process group, under the
confinement launcher (`openglm/agent/confine.py`: a cgroup v2 or a subreaper, so `setsid`
children and double forks die with the step, and everything dies with a killed worker).

Per-command timeout, output truncated to head + tail, the whole tree killed on timeout / cancel /
memory watchdog and when the command exits, and an environment scrubbed of secrets.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from openglm.agent import confine
from openglm.agent.process import pid_record, remove_pidfile
from openglm.agent.tools.limits import ResourceLimiter
from openglm.util import proc as procs

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE", re.I)
_SECRET_PREFIXES = ("AWS_", "AZURE_", "GCP_", "GOOGLE_", "OPENAI_", "ANTHROPIC_", "HF_", "HUGGING", "GITHUB_",
                    "OPENGLM_")


def scrubbed_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not _SECRET.search(k) and not k.startswith(_SECRET_PREFIXES)}
    env.update({"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb"})
    env.update(extra or {})
    return env


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit // 2], text[-(limit // 2):]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters omitted ...]\n{tail}"


@dataclass
class ShellResult:
    exit_code: int | None
    output: str
    timed_out: bool = False
    killed: str = ""  # why the group was killed ("timeout", "cancelled", "memory"), if it was
    duration_s: float = 0.0

    def render(self) -> str:
        status = f"exit code {self.exit_code}" if not self.killed else f"killed ({self.killed})"
        return f"[{status}]\n{self.output}"


LIVE_CAP = 4 << 20  # bytes of live output kept on disk; past it the file restarts (the tail stays visible)


class LiveOutput:
    """The output of the running command as it arrives, in a file the dashboard follows: a first line
    `[<start, epoch seconds>] $ <command>` (a new one per command), then the output. Past LIVE_CAP
    the file restarts from that line, so a long command's latest output stays visible."""

    def __init__(self, path: str, command: str):
        first = command.splitlines()[0][:500] if command else ""
        self.header = f"[{time.time():.6f}] $ {first}\n".encode()
        self.file = open(path, "wb")
        self.file.write(self.header)
        self.file.flush()

    def write(self, chunk: bytes):
        if self.file.tell() + len(chunk) > LIVE_CAP:
            marker = self.header + b"[... earlier output dropped from the live view ...]\n"
            self.file.seek(0)
            self.file.truncate()
            self.file.write(marker)
            chunk = chunk[-max(1, LIVE_CAP - len(marker)):]
        self.file.write(chunk)
        self.file.flush()

    def close(self):
        self.file.close()


def _reader(stream, buf: list, cap: int, live=None):
    # Keep the first `cap` bytes and a rolling tail of `cap` bytes; count the rest.
    head, tail, total = bytearray(), bytearray(), 0
    for chunk in iter(lambda: stream.read1(65536), b""):
        total += len(chunk)
        if live is not None:
            live.write(chunk)
        if len(head) < cap:
            take = cap - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        tail += chunk
        if len(tail) > cap:
            del tail[: len(tail) - cap]
    buf[:] = [bytes(head), bytes(tail), total]


def run_shell(command: str, cwd: str, timeout: float = 600.0, limiter: ResourceLimiter | None = None,
              max_output: int = 20000, should_stop=lambda: False, pidfile=None, output_file=None) -> ShellResult:
    """`pidfile` (optional) holds the command's process-group id while it runs, so a worker that
    resumes after a SIGKILL can kill a command its dead predecessor left running. `output_file`
    (optional) receives the output as it arrives (a fresh file per command)."""
    limiter = limiter or ResourceLimiter(None)
    start = time.monotonic()
    live = LiveOutput(output_file, command) if output_file else None  # before the command: nothing to orphan
    launcher = [sys.executable, "-I", "-S", confine.__file__, str(os.getpid()), "--", "bash", "-c", command]
    proc = procs.spawn(launcher, cwd=cwd, env=scrubbed_env(), stdin=procs.DEVNULL, stdout=procs.PIPE,
                       stderr=procs.STDOUT, preexec_fn=_preexec(os.getpid(), pidfile, limiter))
    buf: list = []
    reader = threading.Thread(target=_reader, args=(proc.stdout, buf, max_output, live), daemon=True)
    reader.start()
    killed, next_mem_check = "", 0.0
    while proc.poll() is None:
        now = time.monotonic()
        if now - start > timeout:
            killed = "timeout"
        elif should_stop():
            killed = "cancelled"
        elif now >= next_mem_check:
            next_mem_check = now + 0.5
            killed = "memory" if limiter.over_memory(proc.pid) else ""
        if killed:
            break
        try:
            proc.wait(0.02 if now - start < 1 else 0.1)
        except subprocess.TimeoutExpired:
            pass
    if killed:
        procs.stop_group(proc.pid)  # the launcher kills the whole tree (cgroup.kill / as subreaper)
    proc.wait()
    procs.kill_group(proc.pid)  # a launcher that died before it could clean up
    if pidfile:
        remove_pidfile(pidfile)
    reader.join(5)
    if live is not None:
        live.close()
    head, tail, total = buf or [b"", b"", 0]
    omitted = total - len(head) - len(tail)
    text = (head + tail).decode("utf-8", "replace") if omitted <= 0 else (
        f"{head.decode('utf-8', 'replace')}\n[... {omitted} bytes omitted ...]\n{tail.decode('utf-8', 'replace')}")
    if killed == "memory":
        limit = limiter.resources.memory_bytes
        text += f"\n[killed: the command's processes exceeded the memory limit of {limit} bytes]"
    return ShellResult(exit_code=None if killed else proc.returncode, output=text, timed_out=killed == "timeout",
                       killed=killed, duration_s=time.monotonic() - start)


def _preexec(parent: int, pidfile, limiter: ResourceLimiter):
    """Runs in the child before exec: die with the worker, and record the group before any user code runs."""

    def setup():
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the worker died before prctl took effect
            os._exit(137)
        if pidfile:
            with open(pidfile, "w") as f:
                f.write(pid_record(os.getpid()))
        if limiter.mode != "none":
            limiter.preexec()

    return setup

