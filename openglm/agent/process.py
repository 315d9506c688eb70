"""Process groups of the commands a run starts, and the pid file that outlives a killed worker.

A shell command runs in its own process group; while it runs, the group id is in the task's
`running.pgid`. A worker that resumes a task after its predecessor was SIGKILLed reads that file and
kills the command the dead worker left running.
"""

from __future__ import annotations

import os
import signal


def running_pidfile(task_dir) -> str:
    """Where a run records the process group of the command it is running (the task dir holds snapshots.git)."""
    return os.path.join(task_dir, "running.pgid")


def live_output_file(task_dir) -> str:
    """Where the running command's output appears as it is produced (the dashboard streams it)."""
    return os.path.join(task_dir, "running.out")


def kill_group(pgid: int) -> None:
    """SIGKILL a whole process group; a group that is already gone is not an error."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_pidfile(pidfile) -> None:
    try:
        os.unlink(pidfile)
    except FileNotFoundError:
        pass


def kill_leftover_commands(task_dir) -> None:
    """Kill the process group of a command an earlier (killed) worker left running."""
    pidfile = running_pidfile(task_dir)
    try:
        with open(pidfile) as f:
            kill_group(int(f.read().strip()))
    except (OSError, ValueError):
        pass
    remove_pidfile(pidfile)
