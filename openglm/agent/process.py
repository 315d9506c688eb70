"""Process groups of the commands a run starts, and the pid file that outlives a killed worker.

A shell command runs in its own process group, in the task's sandbox (bubblewrap; unsandboxed, the
reaper launcher), killed with the worker. While it runs, the task's `running.pgid` records the group
id (bwrap's pid) and the init of the command's pid namespace, each with the host, the boot id and the
process's start time: a worker that resumes the task after its predecessor was SIGKILLed signals them
only if all of them match (on a shared filesystem the record may come from another machine, or from
before a reboot, and the number may since belong to an unrelated process), and waits until the
namespace is empty before it restores the workspace.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from openglm.util.files import write_atomic
from openglm.util.proc import start_time, stop_group
from openglm.util.sandbox import is_sandbox_cgroup, kill_cgroup, kill_namespace


def running_pidfile(task_dir) -> str:
    """Where a run records the process group of the command it is running (the task dir holds snapshots.git)."""
    return os.path.join(task_dir, "running.pgid")


def live_output_file(task_dir) -> str:
    """Where the running command's output appears as it is produced (the dashboard streams it)."""
    return os.path.join(task_dir, "running.out")


def record_init(pidfile, pid: int, init: tuple[int, int], cgroups=()) -> None:
    """Add the sandbox's init, (pid, start time), to the running command's record (a resuming worker then
    kills its namespace and waits until it is empty)."""
    write_atomic(pidfile, pid_record(pid, init, cgroups))


def remove_pidfile(pidfile) -> None:
    try:
        os.unlink(pidfile)
    except FileNotFoundError:
        pass


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_record(pid: int, init: tuple[int, int] | None = None, cgroups=()) -> str:
    """What `running.pgid` holds: enough to tell this very process apart from any other; with `init`,
    the init of the command's sandbox (its pid namespace) and its start time; `cgroups`: the task's
    cgroups, which hold every process of the command."""
    record = {"pgid": pid, "host": socket.gethostname(), "boot_id": boot_id(), "start": start_time(pid),
              "cgroups": sorted(cgroups)}
    if init is not None:
        record.update(init=init[0], init_start=init[1])
    return json.dumps(record)


def read_pgid(pidfile) -> int | None:
    """The process group a live record names, if it is this machine's (None otherwise)."""
    try:
        with open(pidfile) as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return record["pgid"] if isinstance(record, dict) and record_is_ours(record) else None


def record_is_ours(record: dict) -> bool:
    """The record names a live process of this machine and boot, and it is the same process."""
    pgid = record.get("pgid")
    return (isinstance(pgid, int) and pgid > 1 and record.get("host") == socket.gethostname()
            and record.get("boot_id") == boot_id() and record.get("start") is not None
            and record.get("start") == start_time(pgid))


def _this_machine(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and record.get("boot_id") == boot_id()


def _init(record: dict) -> tuple[int, int] | None:
    """The record's sandbox init, if the record is this machine's and names one (kill_namespace then checks
    that the pid is still that process)."""
    init, start = record.get("init"), record.get("init_start")
    if isinstance(init, int) and init > 1 and isinstance(start, int) and _this_machine(record):
        return init, start
    return None


def kill_leftover_commands(task_dir) -> None:
    """Kill the command an earlier (killed) worker left running, if the record is this machine's."""
    pidfile = running_pidfile(task_dir)
    try:
        with open(pidfile) as f:
            text = f.read().strip()
    except OSError:
        return
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        kill_namespace(_init(record))  # the sandbox may outlive its bwrap for a moment: wait until it is gone
    cgroups = record.get("cgroups") if isinstance(record, dict) and _this_machine(record) else None
    for path in cgroups if isinstance(cgroups, list) else []:  # every process of the command, wherever it went
        if isinstance(path, str) and is_sandbox_cgroup(path):
            kill_cgroup(path)
    if isinstance(record, dict) and record_is_ours(record):
        stop_group(record["pgid"])
    elif text:
        print(f"openglm: not signalling the process in {pidfile} ({text}): it is not this machine's, or has "
              "exited since", file=sys.stderr)
    remove_pidfile(pidfile)
