"""Process groups of the commands a run starts, and the pid file that outlives a killed worker.

A shell command runs in its own process group, under the confinement launcher (`confine.py`:
a cgroup v2 or a subreaper, killed with the worker). While it runs, the task's `running.pgid`
records the group id with the host, the boot id and the process's start time: a worker that
resumes the task after its predecessor was SIGKILLed signals that group only if all of them
match (on a shared filesystem the record may come from another machine, or from before a reboot,
and the number may since belong to an unrelated process).
"""

from __future__ import annotations

import json
import os
import socket
import sys

from openglm.util.proc import start_time, stop_group


def running_pidfile(task_dir) -> str:
    """Where a run records the process group of the command it is running (the task dir holds snapshots.git)."""
    return os.path.join(task_dir, "running.pgid")


def live_output_file(task_dir) -> str:
    """Where the running command's output appears as it is produced (the dashboard streams it)."""
    return os.path.join(task_dir, "running.out")


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


def pid_record(pid: int) -> str:
    """What `running.pgid` holds: enough to tell this very process apart from any other."""
    return json.dumps({"pgid": pid, "host": socket.gethostname(), "boot_id": boot_id(), "start": start_time(pid)})


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
    if isinstance(record, dict) and record_is_ours(record):
        stop_group(record["pgid"])
    elif text:
        print(f"openglm: not signalling the process in {pidfile} ({text}): it is not this machine's, or has "
              "exited since", file=sys.stderr)
    remove_pidfile(pidfile)
