"""`openglm bisect`: find the first bad commit with `git bisect run` between a known-good
revision and a bad one (default HEAD), using a shell test command (exit 0 = good, 125 = skip)."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from openglm.util.git import git, run_git


def bisect(repo: str | Path, good: str, command: str, bad: str = "HEAD", timeout: float = 1800) -> dict:
    """Runs in a private worktree so the caller's checkout and bisect state are untouched."""
    repo = Path(repo).resolve()
    good_sha = git(repo, "rev-parse", good).strip()
    bad_sha = git(repo, "rev-parse", bad).strip()
    work = Path(tempfile.mkdtemp(prefix="openglm-bisect-"))
    tree = work / "tree"
    git(repo, "worktree", "add", "--quiet", "--detach", str(tree), bad_sha)
    try:
        git(tree, "bisect", "start", bad_sha, good_sha)
        proc = run_git(["bisect", "run", "sh", "-c", command], tree, timeout=timeout, text=True)
        if proc.timed_out:
            raise TimeoutError(f"git bisect run `{command}` did not finish in {timeout:g}s (killed)")
        log = proc.stdout + proc.stderr
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
