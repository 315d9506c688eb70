"""bisect: `git bisect run` automation finds the commit that broke the test command."""

from __future__ import annotations

from openglm.swe.bisect import bisect
from openglm.util.git import git


def test_finds_first_bad_commit(make_repo, commit_all):
    repo, good = make_repo("b", {"lib.py": "def f():\n    return 1\n", "notes.txt": "0\n"})
    shas = []
    for i in range(1, 7):
        if i == 4:
            (repo / "lib.py").write_text("def f():\n    return 2\n")
        else:
            (repo / "notes.txt").write_text(f"{i}\n")
        shas.append(commit_all(repo, f"change {i}"))
    head_before = git(repo, "rev-parse", "HEAD").strip()
    cmd = "python3 -c 'import lib, sys; sys.exit(0 if lib.f() == 1 else 1)'"
    result = bisect(repo, good, cmd)
    assert result["first_bad_commit"] == shas[3]
    assert result["subject"] == "change 4" and result["files"] == ["lib.py"]
    # the caller's checkout is untouched and no worktree is left behind
    assert git(repo, "rev-parse", "HEAD").strip() == head_before
    assert len(git(repo, "worktree", "list").splitlines()) == 1
