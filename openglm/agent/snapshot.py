"""Differential workspace snapshots in a task-private git directory.

The git directory lives outside the workspace (the runtime's data dir), so the user's own `.git`
is never read or written: git always skips paths named `.git`. The index is kept between
snapshots, so `git add -A` only rehashes files whose stat data changed: a snapshot costs
O(changed files) in hashing plus one stat per file, and stores only new objects. Where inotify exists
(`watch.DirtyPaths`) even the stat pass is limited to the paths that changed since the last
snapshot; whenever the watcher cannot vouch for that (a new watcher after a (re)start, a queue
overflow, a watch limit) the snapshot stages the whole workspace instead.

Rollback first syncs the index with the workspace, then `read-tree -m -u` rewrites exactly the
paths that differ: modified files restored, added files removed, deleted files recreated.
Ignored paths (.venv, caches, ...) are neither stored nor touched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import zlib
from pathlib import Path

from openglm.agent.faults import crashpoint
from openglm.agent.watch import DirtyPaths
from openglm.util.files import write_atomic
from openglm.util.git import run_git

DEFAULT_IGNORE = [".venv/", "venv/", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/",
                  "node_modules/", ".tox/", ".cache/"]


_IGNORED_PATHS = "ignored by one of your .gitignore files"


def _config_env(config: dict[str, str]) -> dict[str, str]:
    """Git config passed in the environment: it holds for snapshot dirs created by older versions too."""
    env = {"GIT_CONFIG_COUNT": str(len(config))}
    for i, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    return env


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


class SnapshotError(RuntimeError):
    pass


class DiskFullError(OSError):
    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


class Snapshots:
    """Snapshots of `workspace` kept in `git_dir` (created on first use)."""

    REF = "refs/heads/snapshots"
    FOLD_BYTES = 64 << 10  # a split part smaller than this is never folded (see _fold_split_index)

    def __init__(self, workspace: str | Path, git_dir: str | Path, ignore: list[str] | None = None,
                 track: bool = True):
        self.workspace = Path(workspace).resolve()
        self.git_dir = Path(git_dir).resolve()
        if self.git_dir == self.workspace / ".git" or self.workspace in self.git_dir.parents:
            raise SnapshotError(f"snapshot git dir {self.git_dir} must be outside the workspace {self.workspace}")
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
                    "GIT_DIR": str(self.git_dir), "GIT_WORK_TREE": str(self.workspace),
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                    "GIT_AUTHOR_NAME": "openglm", "GIT_AUTHOR_EMAIL": "agent@openglm",
                    "GIT_COMMITTER_NAME": "openglm", "GIT_COMMITTER_EMAIL": "agent@openglm",
                    # a split index rewrites only the changed entries (not all 10,000) on every add
                    **_config_env({"core.splitIndex": "true"})}
        if not (self.git_dir / "HEAD").exists():
            self._init(ignore if ignore is not None else DEFAULT_IGNORE)
        self.head = self._git("rev-parse", "--verify", "-q", self.REF, check=False) or ""
        self._head_tree = self._commit_tree(self.head) if self.head else ""
        self._umask = _umask()
        self._modes = self._load_modes(self.head) if self.head else {}  # path -> mode git would not restore
        self._clean_index = None  # index stamp when it last matched head's tree
        self._folded = 0  # index size after the last fold of the split index
        # Watching starts before the first take()/restore(), whose stage is then a full one.
        self._dirty = DirtyPaths(self.workspace, self._ignore_patterns()) if track else None

    def close(self):
        """Stop watching the workspace (the snapshots stay usable, with full rescans)."""
        if self._dirty is not None:
            self._dirty.close()
            self._dirty = None

    def _ignore_patterns(self) -> list[str]:
        try:
            return (self.git_dir / "info" / "exclude").read_text().splitlines()
        except FileNotFoundError:
            return []

    def _git(self, *args: str, check: bool = True, paths: list[str] | None = None) -> str:
        """Run git; `paths` go to its stdin as literal, NUL-separated pathspecs."""
        env, stdin = self.env, None
        if paths is not None:  # (C messages: the one about ignored paths is matched below)
            env = dict(self.env, GIT_LITERAL_PATHSPECS="1", LC_ALL="C")
            stdin = b"\0".join(os.fsencode(path) for path in paths)
            args += ("--pathspec-from-file=-", "--pathspec-file-nul")
        p = run_git(args, self.workspace, env=env, input=stdin)
        stdout, stderr = os.fsdecode(p.stdout), p.stderr.decode(errors="replace")
        # `add` naming an ignored path (a user's .gitignore) exits 1 after staging the others: fine
        if p.returncode != 0 and check and not (p.returncode == 1 and _IGNORED_PATHS in stderr):
            if "No space left on device" in stderr:
                raise DiskFullError(f"git {args[0]}: {stderr.strip()}")
            raise SnapshotError(f"git {' '.join(args)} failed: {stderr.strip()}")
        return stdout.strip()

    def _init(self, ignore: list[str]):
        self.git_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.git_dir.with_name(self.git_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        env = dict(self.env, GIT_DIR=str(tmp))
        for args in [("init", "-q"), ("config", "core.autocrlf", "false"), ("config", "gc.auto", "0"),
                     ("config", "core.excludesFile", os.devnull), ("config", "core.untrackedCache", "true"),
                     ("config", "core.quotePath", "false")]:
            p = run_git(args, self.workspace, env=env, text=True)
            if not p.ok:
                raise SnapshotError(f"git {' '.join(args)} failed: {p.stderr.strip()}")
        (tmp / "info").mkdir(exist_ok=True)
        (tmp / "info" / "exclude").write_text("\n".join(ignore) + "\n")
        os.replace(tmp, self.git_dir)  # a half-initialised dir is never mistaken for a real one

    def _clear_stale_locks(self):
        # A SIGKILL during `git add` leaves index.lock; we hold the task's lease, so it is stale.
        for name in ("index.lock", "HEAD.lock", f"{self.REF}.lock"):
            try:
                (self.git_dir / name).unlink()
            except FileNotFoundError:
                pass

    def _stage(self):
        """Bring the index up to date with the workspace: just the changed paths when they are known."""
        changes = self._dirty.drain() if self._dirty is not None else None
        try:
            if changes is None or not self._stage_paths(changes):
                self._add_all()
                self._scan_modes()
            else:
                self._update_modes(changes)
            self._settle()
        except BaseException:  # the drained changes are not staged: the next stage must be a full one
            if self._dirty is not None:
                self._dirty.forget()
            raise

    def _add_all(self):
        try:
            self._git("add", "-A", "--ignore-errors", ".")
        except SnapshotError as e:
            if "sharedindex" not in str(e):
                raise
            # Git deletes the old shared index just before its new index replaces the old one: a
            # kill in between leaves an index that cannot be read. Start it afresh (rehashes all).
            (self.git_dir / "index").unlink(missing_ok=True)
            self._git("add", "-A", "--ignore-errors", ".")

    def _settle(self):
        if self._dirty is not None:
            self._dirty.settle()

    def _stage_paths(self, changes: dict[str, bool]) -> bool:
        present, gone = [], []
        for path, created in changes.items():
            if os.path.lexists(self.workspace / path):
                present.append(path)
            elif not created:  # it may be in the index (a path created after the last stage is not)
                gone.append(path)
        try:
            if present:  # no preload threads: they cost more than the few lstat calls they share
                self._git("-c", "core.preloadIndex=false", "add", "-A", "--ignore-errors", paths=present)
            if gone:
                self._git("rm", "-r", "-q", "--cached", "--ignore-unmatch", paths=gone)
        except DiskFullError:
            raise
        except SnapshotError:  # e.g. a path vanished between the check and git: rescan to be sure
            return False
        return True

    def take(self, message: str = "snapshot") -> str:
        """Record the workspace; returns the snapshot id (unchanged workspace -> the previous id)."""
        self._clear_stale_locks()
        self._stage()
        crashpoint("snapshot_after_add")
        index = self._index_stamp()
        if self.head and index == self._clean_index:  # git rewrites the index whenever it changes
            return self.head
        # --missing-ok skips an existence check of every entry in the changed directories: the
        # blobs were written by `git add` before it wrote the index
        tree = self._git("write-tree", "--missing-ok")
        self._fold_split_index()
        self._clean_index = self._index_stamp()
        if self.head and self._head_tree == tree:
            return self.head
        commit = self._write_commit(tree, self.head, message)
        if self._modes:
            write_atomic(self.git_dir / "modes" / commit, json.dumps(self._modes, sort_keys=True))
        self._set_head(commit, tree)
        return commit

    # Git stores only 644/755: the exact modes of the other files (0600 keys, 0700 scripts, ...) are kept
    # beside the commit, in modes/<commit>, and put back by restore().
    def _default_mode(self, mode: int) -> int:
        return (0o777 if mode & 0o100 else 0o666) & ~self._umask

    def _note_mode(self, rel: str) -> None:
        try:
            st = os.lstat(self.workspace / rel)
        except OSError:
            self._modes.pop(rel, None)
            return
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISREG(st.st_mode) and mode != self._default_mode(mode):
            self._modes[rel] = mode
        else:
            self._modes.pop(rel, None)

    def _update_modes(self, changes: dict[str, bool]) -> None:
        for rel in changes:
            full = self.workspace / rel
            if full.is_dir() and not full.is_symlink():
                prefix = rel.rstrip("/") + "/"
                for known in [k for k in self._modes if k.startswith(prefix)]:
                    self._note_mode(known)
                for root, dirs, files in os.walk(full):
                    dirs[:] = [d for d in dirs if d != ".git"]
                    for name in files:
                        self._note_mode(os.path.relpath(os.path.join(root, name), self.workspace))
            else:
                self._note_mode(rel)

    def _scan_modes(self) -> None:
        self._modes = {}
        for rel in self._git("ls-files", "-z").split("\0"):
            if rel:
                self._note_mode(rel)

    def _load_modes(self, commit: str) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads((self.git_dir / "modes" / commit).read_text()).items()}
        except (FileNotFoundError, ValueError, AttributeError):  # none recorded (or unreadable): git's modes
            return {}

    def _restore_modes(self, commit: str) -> None:
        target = self._load_modes(commit)
        root = os.path.realpath(self.workspace)
        for rel in set(self._modes) | set(target):
            full = os.path.join(root, rel)
            if not os.path.realpath(full).startswith(root + os.sep):  # never chmod outside (a dir now a symlink)
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            want = target.get(rel, self._default_mode(mode)) & 0o7777
            if want != mode:
                os.chmod(full, want)
        self._modes = target

    def _fold_split_index(self):
        """The split part holds every entry changed since the shared part was written, so it grows
        over a long task; once it has grown a lot, move everything into a new shared part (a full
        index write, rarely) and delete the old one, which only this index used."""
        shared = list(self.git_dir.glob("sharedindex.*"))
        size = (self._index_stamp() or (0, 0, 0))[2]
        if not shared or size - self._folded < max(max(p.stat().st_size for p in shared) // 2, self.FOLD_BYTES):
            return
        self._git("update-index", "--split-index")
        current = Path(self._git("rev-parse", "--shared-index-path")).name
        for path in shared:
            if path.name != current:
                path.unlink(missing_ok=True)
        # what stays in the split part (entries git holds back, e.g. racily clean ones) does not count
        self._folded = (self._index_stamp() or (0, 0, 0))[2]

    # Commit objects and the ref are written here rather than by `git commit-tree` / `update-ref`:
    # two process spawns fewer per step. The bytes are exactly what git would write.
    _SIGNATURE = "openglm <agent@openglm> 946684800 +0000"

    def _write_commit(self, tree: str, parent: str, message: str) -> str:
        body = f"tree {tree}\n" + (f"parent {parent}\n" if parent else "")
        body += f"author {self._SIGNATURE}\ncommitter {self._SIGNATURE}\n\n{message}\n"
        raw = f"commit {len(body.encode())}\0{body}".encode()
        sha = hashlib.sha1(raw).hexdigest()
        path = self.git_dir / "objects" / sha[:2] / sha[2:]
        if not path.exists():
            write_atomic(path, zlib.compress(raw))
        return sha

    def _commit_tree(self, commit: str) -> str:
        path = self.git_dir / "objects" / commit[:2] / commit[2:]
        if path.exists():
            header = zlib.decompress(path.read_bytes()).split(b"\0", 1)[1]
            return header[5:45].decode()  # "tree <40 hex>"
        return self._git("rev-parse", f"{commit}^{{tree}}")

    def _index_stamp(self):
        try:
            st = os.stat(self.git_dir / "index")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _set_head(self, commit: str, tree: str | None = None):
        write_atomic(self.git_dir / self.REF, (commit + "\n").encode())
        self.head = commit
        self._head_tree = tree or self._commit_tree(commit)

    def restore(self, snapshot_id: str) -> None:
        """Make the workspace exactly equal to snapshot `snapshot_id` (outside ignored paths)."""
        self._clear_stale_locks()
        self._stage()
        crashpoint("restore_after_add")
        # A one-way merge keeps unchanged entries' stat data, so only the differing paths are looked
        # at (--reset lstats every file). It refuses when a file it would overwrite does not match
        # the index, before touching anything: then resync everything and overwrite.
        try:
            self._git("read-tree", "-m", "-u", snapshot_id)
        except DiskFullError:
            raise
        except SnapshotError:
            self._add_all()
            self._git("read-tree", "-u", "--reset", snapshot_id)
        self._restore_modes(snapshot_id)
        self._settle()  # the files it wrote are in the index
        if snapshot_id != self.head:
            self._set_head(snapshot_id)
        self._clean_index = self._index_stamp()

    def changed_files(self, old: str, new: str) -> list[tuple[str, str]]:
        """[(status A/M/D, path)] between two snapshots."""
        out = self._git("diff-tree", "-r", "--no-renames", "--name-status", old, new)
        return [tuple(line.split("\t", 1)) for line in out.splitlines() if line]

    def stored_bytes(self) -> int:
        """Bytes the snapshot store occupies on disk (objects only)."""
        total = 0
        for root, _, files in os.walk(self.git_dir / "objects"):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total
