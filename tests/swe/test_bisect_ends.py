"""bisect answers only when it can be trusted: both ends checked first, uncommitted files the command
names carried into every revision, "could not run" exits (pytest 4/5, shell 126/127) skipped, not bad."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from openglm.swe.bisect import BisectRefused, bisect
from openglm.util.git import git

# no plugin autoload: a bare pytest starts in a tenth of the time
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider"
GOOD_LIB, BAD_LIB = "def f():\n    return 1\n", "def f():\n    return 2\n"
REGRESSION = "from lib import f\n\n\ndef test_f():\n    assert f() == 1\n"


def history(make_repo, commit_all, files=None, breaks_at=4, n=6, edits=None, setup=None):
    """A repo whose lib.f() breaks at commit `breaks_at` of `n` (others touch notes.txt or apply `edits`);
    `setup(repo)`, if given, is committed first and is the good revision."""
    repo, good = make_repo("r", {"lib.py": GOOD_LIB, "notes.txt": "0\n", **(files or {})})
    if setup is not None:
        setup(repo)
        good = commit_all(repo, "setup")
    shas = []
    for i in range(1, n + 1):
        change = (edits or {}).get(i)
        if i == breaks_at:
            (repo / "lib.py").write_text(BAD_LIB)
        elif callable(change):
            change(repo)
        else:
            (repo / "notes.txt").write_text(f"{i}\n")
        shas.append(commit_all(repo, f"change {i}"))
    return repo, good, shas


def test_a_new_untracked_regression_test_is_carried_into_every_revision(make_repo, commit_all):
    """The first user's case: a new, uncommitted test file. The private worktree lacked it, pytest exited 4
    at every revision, which counted as bad: the first commit after --good was named, with exit 0."""
    repo, good, shas = history(make_repo, commit_all)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_regress.py").write_text(REGRESSION)
    result = bisect(repo, good, f"{PYTEST} tests/test_regress.py")
    assert result["first_bad_commit"] == shas[3] and result["subject"] == "change 4"
    assert result["carried"] == ["tests/test_regress.py"]
    assert result["ends"]["good"]["exit"] == 0 and result["ends"]["bad"]["exit"] == 1
    # the caller's checkout is as it was: the file still untracked there, no worktree left
    assert (repo / "tests" / "test_regress.py").read_text() == REGRESSION
    assert git(repo, "status", "--porcelain").split() == ["??", "tests/"]
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_an_uncommitted_test_in_a_tracked_file_is_carried(make_repo, commit_all):
    """A new test function added to a tracked test file (named by node id); a commit in the range also
    edits that file, so the step must put each revision's own version back before git moves on."""
    base = "from lib import f\n\n\ndef test_exists():\n    assert f\n"
    edit = {2: lambda repo: (repo / "tests" / "test_lib.py").write_text(base + "\n# a committed edit\n")}
    repo, good, shas = history(make_repo, commit_all, {"tests/test_lib.py": base}, edits=edit)
    (repo / "tests" / "test_lib.py").write_text((repo / "tests" / "test_lib.py").read_text() +
                                                "\n\ndef test_new():\n    assert f() == 1\n")
    result = bisect(repo, good, f"{PYTEST} tests/test_lib.py::test_new")
    assert result["first_bad_commit"] == shas[3]
    assert result["carried"] == ["tests/test_lib.py"]


def test_a_named_folder_carries_its_new_files(make_repo, commit_all):
    repo, good, shas = history(make_repo, commit_all, {"tests/test_old.py": "def test_old():\n    pass\n"})
    (repo / "tests" / "test_regress.py").write_text(REGRESSION)
    result = bisect(repo, good, f"{PYTEST} tests")
    assert result["first_bad_commit"] == shas[3] and result["carried"] == ["tests/test_regress.py"]


@pytest.mark.parametrize("how", ["shell 127", "pytest 4"])
def test_revisions_where_the_command_cannot_run_are_skipped_not_bad(make_repo, commit_all, how):
    """Commits 2 and 3 lack the test (script or test file): could-not-run there is a skip. Counted as bad,
    as before, they made commit 2 the answer."""
    if how == "shell 127":
        check = "python3 -c 'import lib, sys; sys.exit(lib.f() != 1)'\n"
        files, rel, cmd = {"check.sh": check}, "check.sh", "./check.sh"
    else:
        files, rel, cmd = {"tests/test_lib.py": REGRESSION}, "tests/test_lib.py", f"{PYTEST} tests/test_lib.py"
    saved = {}

    def remove(repo):
        saved["text"] = (repo / rel).read_text()
        (repo / rel).unlink()

    def restore(repo):
        (repo / rel).write_text(saved["text"])
        os.chmod(repo / rel, 0o755)

    executable = (lambda repo: os.chmod(repo / rel, 0o755)) if how == "shell 127" else None
    repo, good, shas = history(make_repo, commit_all, files, breaks_at=5, n=7, edits={2: remove, 4: restore},
                               setup=executable)
    result = bisect(repo, good, cmd)
    assert result["first_bad_commit"] == shas[4], result["log"]
    assert "could not run at this revision (skipped)" in result["log"]


def test_refuses_when_the_good_end_fails(make_repo, commit_all):
    repo, good, _ = history(make_repo, commit_all)
    with pytest.raises(BisectRefused, match=r"fails at --good .* too \(exit 1\).*give a --good revision"):
        bisect(repo, good, "python3 -c 'import lib, sys; sys.exit(lib.f() != 3)'")
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_refuses_when_the_bad_end_passes(make_repo, commit_all):
    """Before, a command that passes everywhere named HEAD as the first bad commit."""
    repo, good, _ = history(make_repo, commit_all)
    with pytest.raises(BisectRefused, match=r"passes at --bad HEAD .*nothing to bisect"):
        bisect(repo, good, "true")


def test_refuses_when_the_command_cannot_run_at_an_end(make_repo, commit_all):
    repo, good, _ = history(make_repo, commit_all)
    with pytest.raises(BisectRefused, match=r"cannot run at --bad HEAD .*exit 127 \(command not found\)"):
        bisect(repo, good, "no-such-tool --check")
    with pytest.raises(BisectRefused, match=r"cannot run at --bad .*exit 4 .*last output: .*not found"):
        bisect(repo, good, f"{PYTEST} tests/test_gone.py")


def test_refuses_a_relative_path_out_of_the_repository(make_repo, commit_all, tmp_path):
    repo, good, _ = history(make_repo, commit_all)
    (tmp_path / "helper.sh").write_text("exit 0\n")
    with pytest.raises(BisectRefused, match=r"names \.\./helper\.sh, outside the repository"):
        bisect(repo, good, "sh ../helper.sh")


def test_cli_refusal_is_one_line_and_exit_2(make_repo, commit_all, capsys):
    from openglm.cli import main

    repo, good, _ = history(make_repo, commit_all)
    assert main(["bisect", str(repo), "--good", good, "--cmd", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openglm bisect: the command passes at --bad HEAD") and len(err.splitlines()) == 1


def test_a_repository_given_by_a_subfolder_carries_paths_from_its_top(make_repo, commit_all):
    repo, good, shas = history(make_repo, commit_all, {"src/keep.txt": "x\n"})
    (repo / "tests").mkdir()
    (repo / "tests" / "test_regress.py").write_text(REGRESSION)
    result = bisect(repo / "src", good, f"{PYTEST} tests/test_regress.py")  # paths in the command: from the top
    assert result["first_bad_commit"] == shas[3] and result["carried"] == ["tests/test_regress.py"]
