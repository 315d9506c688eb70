"""The reaper launcher: `python -I -S reaper.py PARENT_PID [--no-cgroup] -- bash -c COMMAND`.

A task's commands run under it when the sandbox is switched off (`--unsafe-no-sandbox`; in the
sandbox, bubblewrap's pid namespace does this job). The launcher puts itself (and so the whole
command) in a fresh cgroup v2 when the machine offers one (killing = writing `cgroup.kill`: nothing
escapes by `setsid` or a double fork), and is a child subreaper either way (PR_SET_CHILD_SUBREAPER:
orphaned descendants are re-parented to it, not to init, so it can still find and kill them).
It ends the command's whole tree when
  - the command's main process exits (background children would otherwise outlive the step),
  - it gets SIGTERM (the worker's timeout / cancel / memory kill), or
  - the worker dies (PR_SET_PDEATHSIG delivers SIGTERM), even by SIGKILL,
and exits with the command's status (128 + signal number if it was killed). Stdlib only: it starts
in a few tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_LIBC = ctypes.CDLL(None, use_errno=True)


def cgroup2_root() -> str | None:
    """The directory of this process's own cgroup in the cgroup v2 hierarchy (pure v2 or the
    `unified` mount of a hybrid set-up), or None."""
    mount = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    mount = left.split()[4]
                    break
        with open("/proc/self/cgroup") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if mount is None or own is None:
        return None
    return os.path.join(mount, own.lstrip("/"))


def make_cgroup() -> str | None:
    """A new cgroup with cgroup.kill holding this process, or None where that is not possible."""
    root = cgroup2_root()
    if root is None:
        return None
    sweep(root)
    path = os.path.join(root, f"openglm-step-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        if not os.path.exists(os.path.join(path, "cgroup.kill")):
            os.rmdir(path)
            return None
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return path
    except OSError:
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None


def sweep(root: str) -> None:
    """Remove the (empty) step cgroups of launchers that were SIGKILLed before they could: their pid is in the
    name, and a cgroup that still holds a process is not removed."""
    try:
        names = [n for n in os.listdir(root) if n.startswith("openglm-step-")]
    except OSError:
        return
    for name in names:
        pid = name.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def kill_descendants() -> None:
    """SIGKILL every descendant (as subreaper, orphans are our children too) until none is left."""
    me = os.getpid()
    for _ in range(100):
        found, todo = [], children(me)
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children(pid)
        if not found:
            reap(block=False)
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(block=False)
        time.sleep(0.01)


def kill_all(cgroup: str | None) -> None:
    """Kill the command's whole tree: the step cgroup in one go (after stepping out of it, so this
    process can still clean up), then any descendant the subreaper holds."""
    if cgroup is not None:
        try:
            with open(os.path.join(os.path.dirname(cgroup), "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                left = f.read().split()
            if left:  # the common case after a clean exit is an empty cgroup: nothing to kill or wait for
                with open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
                    f.write("1")
        except OSError:
            pass
    kill_descendants()
    if cgroup is not None:
        for _ in range(200):  # the kernel empties a killed cgroup asynchronously
            try:
                os.rmdir(cgroup)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)


def reap(block: bool) -> list[tuple[int, int]]:
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block and not done else os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def main(argv: list[str]) -> int:
    parent, options, command = int(argv[0]), argv[1:argv.index("--")], argv[argv.index("--") + 1:]
    _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1)
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before PDEATHSIG was armed
        return 137
    cgroup = None if "--no-cgroup" in options else make_cgroup()  # --no-cgroup: the subreaper alone

    def terminate(signum, frame):
        kill_all(cgroup)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    main_pid = os.posix_spawnp(command[0], command, os.environ)
    status = None
    while status is None:
        for pid, st in reap(block=True):
            if pid == main_pid:
                status = os.waitstatus_to_exitcode(st)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all(cgroup)  # what the command left running in the background dies with the step
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
