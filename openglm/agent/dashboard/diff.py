"""The diff a rollback would apply: a snapshot against the workspace as it is now.

The workspace is staged into a throw-away index (never the runtime's own, which a worker may be
using), so the diff includes edits made outside the agent and new files; the task's ignore rules
(the snapshot dir's info/exclude) hold as for snapshots.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from openglm.util.git import run_git

MAX_DIFF = 400_000  # characters of patch text sent to the page
GIT_TIMEOUT_S = 120


class DiffError(RuntimeError):
    pass


def _git(env, cwd, *args) -> str:
    p = run_git(args, cwd, env=env, timeout=GIT_TIMEOUT_S, text=True)
    if not p.ok:
        raise DiffError(f"git {args[0]}: {p.stderr.strip() or f'no answer in {GIT_TIMEOUT_S}s'}")
    return p.stdout


def snapshot_vs_workspace(git_dir: Path, workspace: str, snapshot: str) -> dict:
    """{"stat": ..., "patch": ..., "truncated": bool, "files": n, "name_status": ["A\tpath", ...]} of `snapshot` ->
    current workspace (a path added there is one a rollback deletes)."""
    if not (git_dir / "HEAD").exists():
        raise DiffError(f"no snapshots yet in {git_dir}")
    with tempfile.TemporaryDirectory(prefix="openglm-diff-") as tmp:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
               "GIT_DIR": str(git_dir), "GIT_WORK_TREE": workspace, "GIT_INDEX_FILE": os.path.join(tmp, "index"),
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}
        _git(env, workspace, "read-tree", snapshot)  # stat-less entries: add -A rehashes what differs
        _git(env, workspace, "add", "-A")
        stat = _git(env, workspace, "diff", "--cached", "--stat=120", snapshot)
        names = _git(env, workspace, "diff", "--cached", "--name-status", "--no-renames", snapshot)
        patch = _git(env, workspace, "diff", "--cached", "--no-color", snapshot)
    return {"snapshot": snapshot, "stat": stat, "files": len(names.splitlines()),
            "name_status": names.splitlines()[:2000],
            "patch": patch[:MAX_DIFF], "truncated": len(patch) > MAX_DIFF}
