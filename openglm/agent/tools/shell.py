"""The shell tool: one bash command in the workspace, in the task's sandbox (`openglm.util.sandbox`:
bubblewrap, its own pid namespace, so `setsid` children and double forks die with the step, and
everything dies with a killed worker), in its own process group.

Per-command timeout, output truncated to head + tail, the whole tree killed on timeout / cancel /
memory watchdog and when the command exits, and an environment scrubbed of secrets.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from openglm.agent.process import pid_record, record_init, remove_pidfile
from openglm.util import proc as procs
from openglm.util.sandbox import Sandbox, SandboxConfig, kill_namespace, namespace_init

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
SHELL_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb"}  # nothing waits for a terminal


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
    oom_kills: int = 0  # processes the kernel killed for the task's memory limit during the command

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


def run_shell(command: str, cwd: str, timeout: float = 600.0, sandbox: Sandbox | None = None,
              max_output: int = 20000, should_stop=lambda: False, pidfile=None, output_file=None) -> ShellResult:
    """`sandbox`: the task's (default: a fresh one with the default config, for `cwd`); SandboxUnavailable
    when it cannot be set up. `pidfile` (optional) holds the command's process-group id while it runs,
    so a worker that resumes after a SIGKILL can kill a command its dead predecessor left running.
    `output_file` (optional) receives the output as it arrives (a fresh file per command)."""
    if sandbox is None:
        sandbox = Sandbox(SandboxConfig(), cwd)
        try:
            return run_shell(command, cwd, timeout, sandbox, max_output, should_stop, pidfile, output_file)
        finally:
            sandbox.close()
    start = time.monotonic()
    sandbox.check()  # refused here, before anything starts
    live = LiveOutput(output_file, command) if output_file else None  # before the command: nothing to orphan
    ooms = sandbox.oom_kills()
    proc = procs.spawn(["bash", "-c", command], cwd=cwd, env=sandbox.env(SHELL_ENV), stdin=procs.DEVNULL,
                       stdout=procs.PIPE, stderr=procs.STDOUT,
                       preexec_fn=_preexec(os.getpid(), pidfile, sorted(set(sandbox.cgroups.dirs.values()))),
                       sandbox=sandbox)
    buf: list = []
    reader = threading.Thread(target=_reader, args=(proc.stdout, buf, max_output, live), daemon=True)
    reader.start()
    killed, next_mem_check, init = "", 0.0, None
    while proc.poll() is None:
        if init is None and sandbox.mode == "bwrap":
            init = namespace_init(proc.pid)  # bwrap forks it at once
            if init is not None and pidfile:
                record_init(pidfile, proc.pid, init, set(sandbox.cgroups.dirs.values()))
        now = time.monotonic()
        if now - start > timeout:
            killed = "timeout"
        elif should_stop():
            killed = "cancelled"
        elif now >= next_mem_check:
            next_mem_check = now + 0.5
            killed = "memory" if sandbox.over_memory(proc.pid) else ""
        if killed:
            break
        try:
            proc.wait(0.02 if now - start < 1 else 0.1)
        except subprocess.TimeoutExpired:
            pass
    if killed:
        sandbox.stop(proc.pid, init)  # returns once every process of the command is gone
    proc.wait()
    procs.kill_group(proc.pid)  # a launcher that died before it could clean up
    kill_namespace(init)  # bwrap killed from elsewhere (the resource monitor): its namespace may still be dying
    if pidfile:
        remove_pidfile(pidfile)
    reader.join(5)
    if live is not None:
        live.close()
    head, tail, total = buf or [b"", b"", 0]
    omitted = total - len(head) - len(tail)
    text = (head + tail).decode("utf-8", "replace") if omitted <= 0 else (
        f"{head.decode('utf-8', 'replace')}\n[... {omitted} bytes omitted ...]\n{tail.decode('utf-8', 'replace')}")
    ooms = sandbox.oom_kills() - ooms
    if killed == "memory" or ooms:
        text += (f"\n[killed: the command's processes exceeded the memory limit of {sandbox.memory_bytes} bytes"
                 + (f" ({ooms} killed by the kernel)]" if ooms else "]"))
    return ShellResult(exit_code=None if killed else proc.returncode, output=text, timed_out=killed == "timeout",
                       killed=killed, duration_s=time.monotonic() - start, oom_kills=ooms)


def _preexec(parent: int, pidfile, cgroups=()):
    """Runs in the child before exec: die with the worker, and record the group (and the task's cgroups,
    which it is about to join) before any user code runs."""

    def setup():
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the worker died before prctl took effect
            os._exit(137)
        if pidfile:
            with open(pidfile, "w") as f:
                f.write(pid_record(os.getpid(), cgroups=cgroups))

    return setup

