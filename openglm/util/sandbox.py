"""The sandbox a task's commands run in (the bash tool, deliverable commands, the SWE policy's checks):
bubblewrap (`bwrap`), the namespace launcher Flatpak and others build on.

A sandboxed command sees:
  - the workspace read-write, and a private, size-capped /tmp and /dev/shm; nothing else is writable;
  - the host's system directories read-only (/usr, /bin, /sbin, /lib*, and /etc without the entries only
    their owner may read, such as /etc/shadow), the Python that runs openglm and openglm's own package
    (the SWE checks run `python -m openglm...`), and the config's `read_only` paths; nothing else of the
    host: not the data dir (task store, snapshot repositories), not home directories, not /run's sockets;
  - no network (a network namespace holding only loopback) unless the task may use it;
  - an unprivileged user (uid 65534 in a user namespace of its own: no capabilities), which cannot make
    further user namespaces;
  - a pid namespace of its own: when the command's main process exits, or bwrap is killed (the step's
    timeout, a cancel, the worker's death through --die-with-parent), the kernel kills every process in
    it, whatever it did to leave its process group.
Limits: processes (a `pids` cgroup for the task's commands, else RLIMIT_NPROC inside the user namespace;
the kernel does not apply that rlimit to the host's root, so a server running as root needs the cgroup),
memory (a `memory` cgroup, else RLIMIT_AS per process and the caller's watchdog on the tree's RSS), CPU
seconds (RLIMIT_CPU), file size (RLIMIT_FSIZE), /tmp size. `Sandbox.describe()` says which applied.

With `SandboxConfig.enabled` false (the agent-server's `--unsafe-no-sandbox`) commands run unconfined
under the reaper launcher (`reaper.py`: their process tree still dies with the step) with the same
rlimits and cgroups. Where bwrap cannot run (not installed, user namespaces disabled) `refusal()` says
why and `wrap` raises `SandboxUnavailable`: the runtime refuses to run the command.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import signal
import site
import stat
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from openglm.util import proc
from openglm.util.strict import check_keys

GiB = 1 << 30
SANDBOX_UID = 65534  # "nobody" inside the sandbox's user namespace
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
OPENGLM_DIR = str(Path(__file__).resolve().parents[1])  # the package a check imports
REAPER = str(Path(__file__).with_name("reaper.py"))
ETC_WALK_LIMIT = 50_000  # entries of /etc looked at for owner-only files (a normal /etc has ~1-3k)
# Sets RLIMIT_NPROC inside the user namespace, where the kernel counts the sandbox's processes only.
_NPROC_LAUNCHER = ("import os, resource, sys; n = int(sys.argv[1]); "
                   "resource.setrlimit(resource.RLIMIT_NPROC, (n, n)); os.execvp(sys.argv[3], sys.argv[3:])")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here; the message says why and what to do."""


@dataclass
class SandboxConfig:
    """How a task's commands are confined (AgentConfig.sandbox; docs/agent.md, "Sandbox")."""

    enabled: bool = True  # False: commands run unconfined (`--unsafe-no-sandbox`, logged loudly)
    allow_network: bool = False  # whether a task may ask for the network (its constraint `"network": true`)
    read_only: list[str] = field(default_factory=list)  # more host paths the commands may read (e.g. /opt/tool)
    processes: int = 1024  # processes (threads, with a pids cgroup) a task's commands may have at once
    memory_bytes: int | None = None  # for a task whose `resource` names no memory; None: half this machine's RAM
    file_bytes: int = 8 * GiB  # the largest file a command may write
    tmp_bytes: int = 1 * GiB  # size of the private /tmp and /dev/shm (memory-backed)
    cpu_s: int | None = None  # CPU seconds per process; None: the command timeout times the task's CPUs

    def __post_init__(self):
        for name in ("processes", "memory_bytes", "file_bytes", "tmp_bytes", "cpu_s"):
            value = getattr(self, name)
            if value is None and name in ("memory_bytes", "cpu_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"sandbox.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.read_only, list) or not all(isinstance(p, str) and p for p in self.read_only):
            raise ValueError(f"sandbox.read_only must be a list of paths, got {self.read_only!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "SandboxConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"sandbox: expected an object, got {type(raw).__name__}")
        check_keys(raw, cls, "key(s) of the sandbox config")
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def probe() -> str | None:
    """None when bwrap can build a sandbox here, else why not (cached: asked once per process)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    true = shutil.which("true") or "/bin/true"
    args = [exe, *_namespace_args(network=False), *_system_args(), "--", true]
    try:
        result = proc.run(args, timeout=30)
    except OSError as e:
        return f"cannot run bwrap: {e}"
    if not result.ok:
        why = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[0]
        return f"bwrap cannot create its namespaces here ({why}); are unprivileged user namespaces disabled?"
    return None


def status(config: SandboxConfig) -> str:
    """How commands run under `config` on this machine, in a few words (for /health and the start-up log)."""
    if not config.enabled:
        return "off (--unsafe-no-sandbox): commands run unconfined"
    reason = probe()
    return "bwrap" if reason is None else f"unavailable: {reason}; commands are refused"


def _namespace_args(network: bool) -> list[str]:
    return ["--unshare-all", "--unshare-user", "--disable-userns", *(["--share-net"] if network else []),
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--die-with-parent", "--new-session"]


def _system_args() -> list[str]:
    """The host's system directories, read-only (merged-/usr symlinks kept as symlinks)."""
    args = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@functools.lru_cache(maxsize=None)
def _owner_only_etc() -> tuple[tuple[str, bool], ...]:
    """(path, is_dir) of each /etc entry the world may not read (shadow, private keys, ...): hidden in the
    sandbox, whose user is the server's user outside (root, if the server runs as root)."""
    found, seen = [], 0
    for root, dirs, files in os.walk("/etc", onerror=lambda e: None):
        keep = []
        for name in dirs:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and (st.st_mode & 0o005) != 0o005:
                found.append((path, True))
            elif stat.S_ISDIR(st.st_mode):
                keep.append(name)
        dirs[:] = keep
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                found.append((path, False))
        seen += len(dirs) + len(files)
        if seen > ETC_WALK_LIMIT:
            break
    return tuple(found)


def _under(path: str, parents) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _python_paths() -> list[str]:
    """What a `python -m openglm...` check needs: the interpreter's prefixes, the user's site-packages,
    openglm's package."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable),
             OPENGLM_DIR}
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user_site and os.path.isdir(user_site):
        paths.add(user_site)
    return sorted(paths)


def _read_only_binds(paths) -> list[tuple[str, str]]:
    """(source, destination) pairs: each path's real location, at its real path and (through a symlink)
    at the path as given, so that both spellings work inside; system dirs and / are skipped."""
    system = [os.path.realpath(p) for p in SYSTEM_DIRS if os.path.exists(p)]
    binds = set()
    for path in paths:
        given = os.path.abspath(os.path.expanduser(path))
        real = os.path.realpath(given)
        if real == "/" or not os.path.exists(real) or _under(real, system) and _under(given, system):
            continue
        binds.add((real, real))
        if given != real:
            binds.add((real, given))
    return sorted(binds, key=lambda b: (b[1].count("/"), b[1]))  # parents before what lies inside them


def _pick_cpus(n: int | None) -> list[int] | None:
    if n is None:
        return None
    available = sorted(os.sched_getaffinity(0))
    return available[: max(1, min(n, len(available)))]  # asking for more than exists = all of them


class Sandbox:
    """The confinement of one task's commands: `wrap(argv)` is the launcher's argv, `preexec` the child's
    limits (both used by `openglm.util.proc.spawn(..., sandbox=)`), `env()` the command's environment.
    `close()` removes the task's cgroups."""

    def __init__(self, config: SandboxConfig, workspace, *, network: bool = False, memory_bytes: int | None = None,
                 cpus: int | None = None, command_timeout_s: float | None = None):
        """`network`, `memory_bytes`, `cpus`: the task's (its constraints); `command_timeout_s` sets the CPU-time
        cap where the config gives none."""
        self.config = config
        self.workspace = os.path.realpath(workspace)
        self.network = bool(network)
        self.mode = "bwrap" if config.enabled else "off"
        self.memory_bytes = memory_bytes or config.memory_bytes or psutil.virtual_memory().total // 2
        self.cpus = _pick_cpus(cpus)
        self.cpu_s = config.cpu_s or (cpu_seconds(command_timeout_s, self.cpus) if command_timeout_s else None)
        self.cgroups = Cgroups(config.processes, self.memory_bytes)
        self._args: list[str] | None = None

    # ---- what the command may use ----
    def refusal(self) -> str | None:
        """Why commands cannot run in this sandbox (None: they can)."""
        if self.mode == "off":
            return None
        if not os.path.isdir(self.workspace):
            return f"the workspace {self.workspace} is not a directory"
        if self.workspace == "/" or any(_under(os.path.realpath(p), [self.workspace]) for p in SYSTEM_DIRS
                                        if os.path.exists(p)):
            return f"the workspace {self.workspace} holds system directories: refusing to make them writable"
        return probe()

    def check(self) -> None:
        """SandboxUnavailable (saying why and what to do) when commands cannot run in this sandbox."""
        reason = self.refusal()
        if reason is not None:
            raise SandboxUnavailable(f"commands are refused: no sandbox ({reason}); install bubblewrap, or start "
                                     "the agent-server with --unsafe-no-sandbox to run them unconfined")

    def wrap(self, argv: list[str], cwd: str | None = None) -> list[str]:
        if self.mode == "off":
            alone = [] if cgroups_wanted() else ["--no-cgroup"]  # (the command's environment has no OPENGLM_*)
            return [sys.executable, "-I", "-S", REAPER, str(os.getpid()), *alone, "--", *argv]
        self.check()
        if self._args is None:
            self._args = self._bwrap_args()
        inner = []
        if "pids" not in self.cgroups.dirs and os.getuid() != 0:
            inner = [sys.executable, "-I", "-S", "-c", _NPROC_LAUNCHER, str(self.config.processes), "--"]
        chdir = os.path.realpath(cwd) if cwd else self.workspace
        return [shutil.which("bwrap") or "bwrap", *self._args, "--chdir", chdir, "--", *inner, *argv]

    def _bwrap_args(self) -> list[str]:
        size = str(self.config.tmp_bytes)
        args = [*_namespace_args(self.network), *_system_args(),
                "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--proc", "/proc",
                "--size", size, "--tmpfs", "/tmp",
                "--ro-bind-try", "/sys/devices/system/cpu", "/sys/devices/system/cpu"]  # CPU counts for tools
        for source, dest in _read_only_binds([*_python_paths(), *self.config.read_only]):
            args += ["--ro-bind", source, dest]
        for path, is_dir in _owner_only_etc():
            args += ["--tmpfs", path, "--remount-ro", path] if is_dir else ["--ro-bind", "/dev/null", path]
        # the root bwrap builds these mounts in is a tmpfs: read-only, so nothing but /tmp can grow in memory
        return args + ["--bind", self.workspace, self.workspace, "--remount-ro", "/"]

    def env(self, extra: dict | None = None) -> dict:
        """The command's environment: this process's without secrets; HOME and TMPDIR in the private /tmp;
        PATH: the bin folder of the Python running openglm first (`python`, `pytest` are its), then the
        host PATH's folders the sandbox shows."""
        inside = {"HOME": "/tmp", "TMPDIR": "/tmp", "PATH": self._path()} if self.mode == "bwrap" else {}
        return proc.scrubbed_env(extra={**inside, **(extra or {})})

    def _path(self) -> str:
        visible = [*SYSTEM_DIRS, *(dest for _, dest in _read_only_binds([*_python_paths(), *self.config.read_only])),
                   self.workspace]
        entries = [os.path.dirname(sys.executable), *os.environ.get("PATH", os.defpath).split(os.pathsep)]
        out = []
        for entry in entries:
            if entry and entry not in out and _under(os.path.abspath(entry), visible):
                out.append(entry)
        return os.pathsep.join(out)

    def preexec(self) -> None:
        """In the child, before exec: join the task's cgroups, pin the CPUs, set the rlimits."""
        self.cgroups.join()
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        _limit(resource.RLIMIT_CORE, 0)
        _limit(resource.RLIMIT_FSIZE, self.config.file_bytes)
        if self.cpu_s:
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 5))  # SIGXCPU, then SIGKILL
        if "memory" not in self.cgroups.dirs:
            _limit(resource.RLIMIT_AS, self.memory_bytes)

    def stop(self, pid: int, init: tuple[int, int] | None = None) -> None:
        """End the command whose launcher is `pid` (`init`: its pid namespace's, from `namespace_init`, if
        known); every process of it has exited when this returns, so nothing it started writes into the
        workspace afterwards."""
        if self.mode == "bwrap":
            kill_namespace(init or namespace_init(pid))  # first: while bwrap lives, its init is findable
        else:
            proc.stop_group(pid)  # SIGTERM: the reaper kills its tree and removes its own cgroup, then exits
        for path in set(self.cgroups.dirs.values()):  # the task's cgroups hold every process of it, bwrap's too
            kill_cgroup(path)
        proc.stop_group(pid)  # bwrap itself

    # ---- what happened ----
    def over_memory(self, pid: int) -> bool:
        """The watchdog's check where no memory cgroup holds the tree: its total RSS above the limit?"""
        if "memory" in self.cgroups.dirs:
            return False
        return sum(_rss(p) for p in proc.tree(pid)) > self.memory_bytes

    def oom_kills(self) -> int:
        return self.cgroups.oom_kills()

    def describe(self) -> dict:
        processes = ("pids cgroup" if "pids" in self.cgroups.dirs else "unlimited (the server runs as root and "
                     "no pids cgroup is available)" if os.getuid() == 0 else "RLIMIT_NPROC")
        return {"sandbox": self.mode if self.refusal() is None else f"unavailable: {self.refusal()}",
                "network": self.network or self.mode == "off", "cpus": self.cpus,
                "memory_bytes": self.memory_bytes,
                "memory_via": "memory cgroup" if "memory" in self.cgroups.dirs else "RLIMIT_AS + watchdog",
                "processes": self.config.processes, "processes_via": processes,
                "file_bytes": self.config.file_bytes, "cpu_s": self.cpu_s, "tmp_bytes": self.config.tmp_bytes}

    def close(self) -> None:
        self.cgroups.remove()


def cgroups_wanted() -> bool:
    """False with OPENGLM_CONFINE_CGROUP=0: no cgroup is made for commands (how a machine without writable
    cgroups behaves; the tests check the pid namespace and the reaper's subreaper alone with it)."""
    return os.environ.get("OPENGLM_CONFINE_CGROUP", "1") != "0"


def namespace_init(bwrap_pid: int) -> tuple[int, int] | None:
    """(pid, start time) of the init of a sandboxed command's pid namespace: bwrap's one child (None: not
    started yet, or gone). The start time tells it apart from a later process given the same pid."""
    try:
        children = psutil.Process(bwrap_pid).children()
    except psutil.Error:
        return None
    start = proc.start_time(children[0].pid) if children else None
    return None if start is None else (children[0].pid, start)


def is_sandbox_cgroup(path) -> bool:
    """Whether `path` names a cgroup a Sandbox made (what a record of a running command may ask to kill)."""
    path = os.path.realpath(str(path))
    return path.startswith("/sys/fs/cgroup/") and os.path.basename(path).startswith("openglm-sandbox-")


def kill_cgroup(path: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of a sandbox's cgroup until it holds none (a process being forked is caught on a
    later round; none can leave the cgroup from inside the sandbox), then wait until each has exited (the
    cgroup stops listing a process a moment before it is done)."""
    deadline, killed = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            pids = []
        if not pids:
            break
        for pid in pids:
            killed.setdefault(pid, proc.start_time(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    for pid, start in killed.items():
        while _still_running(pid, start) and time.monotonic() < deadline:
            time.sleep(0.005)


def _still_running(pid: int, start: int | None) -> bool:
    """Whether the process that had `start` (not a later one given its pid) is there and not yet a zombie."""
    return start is not None and proc.start_time(pid) == start and not proc.exited(pid)


def kill_namespace(init: tuple[int, int] | None, timeout_s: float = 10.0) -> None:
    """SIGKILL a pid namespace's init, (pid, start time), and wait until it has exited: the kernel kills
    every other process of the namespace, and waits for them, before the init itself becomes a zombie. An
    init already gone (or a pid now another process's) is left alone: its namespace is empty."""
    if init is None or not _still_running(*init):
        return
    try:
        os.kill(init[0], signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while _still_running(*init) and time.monotonic() < deadline:
        time.sleep(0.005)


def cpu_seconds(timeout_s: float, cpus: list[int] | None) -> int:
    """A command's CPU-time cap from its wall-clock timeout: all its CPUs busy for the whole of it."""
    return max(1, math.ceil(timeout_s * (len(cpus) if cpus else os.cpu_count() or 1)))


def _limit(which: int, value: int) -> None:
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _rss(p) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


class Cgroups:
    """The cgroups a task's commands run in: `pids.max` caps their processes, the memory limit their
    total memory. cgroup v2 where this process's own cgroup hands those controllers down, else the v1
    hierarchies where they are writable; neither is an error (the rlimits stand in)."""

    def __init__(self, processes: int, memory_bytes: int):
        self.dirs: dict[str, str] = {}  # controller -> the cgroup directory holding it
        self.versions: dict[str, int] = {}
        if not cgroups_wanted():
            return
        name = f"openglm-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        v2 = _own_cgroup_v2()
        if v2 is not None:
            self._make(v2, name, 2, {"pids": [("pids.max", processes)],
                                     "memory": [("memory.max", memory_bytes), ("memory.swap.max", 0)]})
        for controller, limits in (("pids", [("pids.max", processes)]),
                                   ("memory", [("memory.limit_in_bytes", memory_bytes),
                                               ("memory.memsw.limit_in_bytes", memory_bytes)])):
            own = _own_cgroup_v1(controller)
            if controller not in self.dirs and own is not None:
                self._make(own, name, 1, {controller: limits})

    def _make(self, parent: str, name: str, version: int, controllers: dict) -> None:
        _sweep(parent)
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError:
            return
        for controller, limits in controllers.items():
            required, optional = limits[0], limits[1:]  # swap limits are not everywhere
            try:
                _write(os.path.join(path, required[0]), required[1])
            except OSError:
                continue
            for key, value in optional:
                try:
                    _write(os.path.join(path, key), value)
                except OSError:
                    pass
            self.dirs[controller], self.versions[controller] = path, version
        if path not in self.dirs.values():
            _rmdir(path)

    def join(self) -> None:
        for path in set(self.dirs.values()):
            _write(os.path.join(path, "cgroup.procs"), os.getpid())

    def oom_kills(self) -> int:
        path = self.dirs.get("memory")
        if path is None:
            return 0
        name = "memory.events" if self.versions["memory"] == 2 else "memory.oom_control"
        try:
            with open(os.path.join(path, name)) as f:
                return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        for path in set(self.dirs.values()):
            _rmdir(path)
        self.dirs = {}


def _sweep(parent: str) -> None:
    """Remove the (empty) cgroups a killed process left behind: its pid is in their names."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith("openglm-sandbox-")]
    except OSError:
        return
    for name in names:
        pid = name.split("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _rmdir(path: str) -> None:
    for _ in range(200):  # the kernel empties a cgroup asynchronously after its last process exits
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(fstype, mount point, root within the hierarchy, super options) of each cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if rest and rest[0] in ("cgroup", "cgroup2"):
                    out.append((rest[0], fields[4], fields[3], rest[2] if len(rest) > 2 else ""))
    except OSError:
        pass
    return out


def _own_cgroups() -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/self/cgroup ("" controllers: the v2 hierarchy)."""
    try:
        with open("/proc/self/cgroup") as f:
            return [(parts[1], parts[2]) for parts in (line.rstrip("\n").split(":", 2) for line in f)
                    if len(parts) == 3]
    except OSError:
        return []


def _inside(mount: str, root: str, own: str) -> str | None:
    if not own.startswith(root):
        return None
    return os.path.join(mount, own[len(root):].lstrip("/"))


def _own_cgroup_v2() -> str | None:
    own = next((path for controllers, path in _own_cgroups() if controllers == ""), None)
    mount = next((m for m in _mounts() if m[0] == "cgroup2"), None)
    if own is None or mount is None:
        return None
    path = _inside(mount[1], mount[2], own)
    return path if path and os.access(path, os.W_OK) else None


def _own_cgroup_v1(controller: str) -> str | None:
    own = next((path for controllers, path in _own_cgroups() if controller in controllers.split(",")), None)
    mount = next((m for m in _mounts() if m[0] == "cgroup" and controller in m[3].split(",")), None)
    if own is None or mount is None:
        return None
    path = _inside(mount[1], mount[2], own)
    return path if path and os.access(path, os.W_OK) else None
