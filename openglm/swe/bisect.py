"""`openglm bisect`: find the first bad commit with `git bisect run` between a known-good
revision and a bad one (default HEAD), using a shell test command (exit 0 = good, 125 = skip).

With `python` (`--python` / `--venv`), `python` and `python3` in the command are that interpreter
(a folder of links first on PATH), so `python -m pytest ...` runs in the repository's environment.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from openglm.swe.gitutil import git
from openglm.swe.testrun import run_command


def command_env(work: Path, python: str | None) -> dict:
    """The command's environment: `python`/`python3` resolve to `python` when one is given."""
    env = dict(os.environ)
    if python:
        bin_dir = work / "bin"
        bin_dir.mkdir()
        for name in ("python", "python3"):
            os.symlink(python, bin_dir / name)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        venv = Path(python).parent.parent
        if (venv / "pyvenv.cfg").exists():
            env["VIRTUAL_ENV"] = str(venv)
    return env


def bisect(repo: str | Path, good: str, command: str, bad: str = "HEAD", timeout: float = 1800,
           python: str | None = None) -> dict:
    """Runs in a private worktree so the caller's checkout and bisect state are untouched."""
    repo = Path(repo).resolve()
    good_sha = git(repo, "rev-parse", good).strip()
    bad_sha = git(repo, "rev-parse", bad).strip()
    work = Path(tempfile.mkdtemp(prefix="openglm-bisect-"))
    tree = work / "tree"
    git(repo, "worktree", "add", "--quiet", "--detach", str(tree), bad_sha)
    try:
        git(tree, "bisect", "start", bad_sha, good_sha)
        _, log, timed_out = run_command(["git", "bisect", "run", "sh", "-c", command], tree,
                                         env=command_env(work, python), timeout=timeout)
        if timed_out:
            log += f"\n[bisect stopped after {timeout:.0f}s]"
        m = re.search(r"^([0-9a-f]{40}) is the first bad commit", log, re.M)
        result = {"repo": str(repo), "good": good_sha, "bad": bad_sha, "command": command,
                  "first_bad_commit": m.group(1) if m else None, "log": log[-4000:]}
        if m:
            result["subject"] = git(repo, "log", "-1", "--format=%s", m.group(1)).strip()
            result["files"] = git(repo, "show", "--name-only", "--format=", m.group(1)).split()
        git(tree, "bisect", "reset", check=False)
        return result
    finally:
        git(repo, "worktree", "remove", "--force", str(tree), check=False)
        shutil.rmtree(work, ignore_errors=True)
        git(repo, "worktree", "prune", check=False)
