"""Differential workspace snapshots in a task-private git directory.

The git directory lives outside the workspace (the runtime's data dir), so the user's own `.git`
is never read or written: git always skips paths named `.git`. The index is kept between
snapshots, so `git add -A` only rehashes files whose stat data changed: a snapshot costs
O(changed files) in hashing plus one stat per file, and stores only new objects.

Rollback first syncs the index with the workspace, then `read-tree -u --reset` rewrites exactly the
paths that differ: modified files restored, added files removed, deleted files recreated.
Ignored paths (.venv, caches, ...) are neither stored nor touched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path

from openglm.agent.faults import crashpoint

DEFAULT_IGNORE = [".venv/", "venv/", "__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/",
                  "node_modules/", ".tox/", ".cache/"]


class SnapshotError(RuntimeError):
    pass


class DiskFullError(OSError):
    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


class Snapshots:
    """Snapshots of `workspace` kept in `git_dir` (created on first use)."""

    REF = "refs/heads/snapshots"

    def __init__(self, workspace: str | Path, git_dir: str | Path, ignore: list[str] | None = None):
        self.workspace = Path(workspace).resolve()
        self.git_dir = Path(git_dir).resolve()
        if self.git_dir == self.workspace / ".git" or self.workspace in self.git_dir.parents:
            raise SnapshotError(f"snapshot git dir {self.git_dir} must be outside the workspace {self.workspace}")
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
                    "GIT_DIR": str(self.git_dir), "GIT_WORK_TREE": str(self.workspace),
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                    "GIT_AUTHOR_NAME": "openglm", "GIT_AUTHOR_EMAIL": "agent@openglm",
                    "GIT_COMMITTER_NAME": "openglm", "GIT_COMMITTER_EMAIL": "agent@openglm"}
        if not (self.git_dir / "HEAD").exists():
            self._init(ignore if ignore is not None else DEFAULT_IGNORE)
        self.head = self._git("rev-parse", "--verify", "-q", self.REF, check=False) or ""
        self._head_tree = self._commit_tree(self.head) if self.head else ""
        self._clean_index = None  # index stamp when it last matched head's tree

    def _git(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(["git", *args], cwd=self.workspace, env=self.env, capture_output=True, text=True)
        if p.returncode != 0 and check:
            if "No space left on device" in p.stderr:
                raise DiskFullError(f"git {args[0]}: {p.stderr.strip()}")
            raise SnapshotError(f"git {' '.join(args)} failed: {p.stderr.strip()}")
        return p.stdout.strip()

    def _init(self, ignore: list[str]):
        self.git_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.git_dir.with_name(self.git_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        env = dict(self.env, GIT_DIR=str(tmp))
        subprocess.run(["git", "init", "-q"], env=env, cwd=self.workspace, check=True, capture_output=True)
        for key, value in [("core.autocrlf", "false"), ("gc.auto", "0"), ("core.excludesFile", os.devnull),
                           ("core.untrackedCache", "true"), ("core.quotePath", "false")]:
            subprocess.run(["git", "config", key, value], env=env, cwd=self.workspace, check=True)
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

    def take(self, message: str = "snapshot") -> str:
        """Record the workspace; returns the snapshot id (unchanged workspace -> the previous id)."""
        self._clear_stale_locks()
        self._git("add", "-A", "--ignore-errors", ".")
        crashpoint("snapshot_after_add")
        index = self._index_stamp()
        if self.head and index == self._clean_index:  # git rewrites the index whenever it changes
            return self.head
        tree = self._git("write-tree")
        self._clean_index = self._index_stamp()
        if self.head and self._head_tree == tree:
            return self.head
        commit = self._write_commit(tree, self.head, message)
        self._set_head(commit, tree)
        return commit

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
            self._atomic_write(path, zlib.compress(raw))
        return sha

    def _commit_tree(self, commit: str) -> str:
        path = self.git_dir / "objects" / commit[:2] / commit[2:]
        if path.exists():
            header = zlib.decompress(path.read_bytes()).split(b"\0", 1)[1]
            return header[5:45].decode()  # "tree <40 hex>"
        return self._git("rev-parse", f"{commit}^{{tree}}")

    @staticmethod
    def _atomic_write(path, data: bytes):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _index_stamp(self):
        try:
            st = os.stat(self.git_dir / "index")
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _set_head(self, commit: str, tree: str | None = None):
        self._atomic_write(self.git_dir / self.REF, (commit + "\n").encode())
        self.head = commit
        self._head_tree = tree or self._commit_tree(commit)

    def restore(self, snapshot_id: str) -> None:
        """Make the workspace exactly equal to snapshot `snapshot_id` (outside ignored paths)."""
        self._clear_stale_locks()
        self._git("add", "-A", "--ignore-errors", ".")
        crashpoint("restore_after_add")
        self._git("read-tree", "-u", "--reset", snapshot_id)
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
