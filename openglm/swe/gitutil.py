"""Small git helpers (subprocess, no library) shared by the harness, bisect and the generator."""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path

_IDENTITY = {"GIT_AUTHOR_NAME": "openglm", "GIT_AUTHOR_EMAIL": "openglm@localhost",
             "GIT_COMMITTER_NAME": "openglm", "GIT_COMMITTER_EMAIL": "openglm@localhost",
             "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z"}


def git(repo: str | Path, *args: str, input: str | None = None, check: bool = True,
        env: dict | None = None) -> str:
    proc = subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=repo, text=True, input=input,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, **_IDENTITY, **(env or {})})
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout


def init_repo(path: str | Path, message: str = "initial") -> str:
    """git init + commit everything; returns the commit sha."""
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-q", "--no-verify", "-m", message)
    return git(path, "rev-parse", "HEAD").strip()


def commit_file_change(repo: str | Path, parent: str, rel: str, text: str, message: str, ref: str) -> str:
    """Make a commit = parent with `rel` replaced by `text`, without touching the work tree or HEAD;
    `ref` keeps it reachable. Returns its sha."""
    blob = git(repo, "hash-object", "-w", "--stdin", input=text).strip()
    index = Path(repo) / ".git" / f"tmp-index-{os.getpid()}"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(repo, "read-tree", parent, env=env)
        git(repo, "update-index", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
    finally:
        index.unlink(missing_ok=True)
    sha = git(repo, "commit-tree", tree, "-p", parent, "-m", message).strip()
    git(repo, "update-ref", ref, sha)
    return sha


def unified_diff(rel: str, before: str, after: str) -> str:
    """A git-style patch turning `before` into `after` for file `rel` ("" when equal)."""
    if before == after:
        return ""
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{rel}", f"b/{rel}", n=3)
    lines = []
    for line in body:
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return f"diff --git a/{rel} b/{rel}\n" + "".join(lines)
