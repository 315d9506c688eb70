"""Which failing tests localisation follows.

With named tests (`--failing`), those of them that fail are the failing set, a named test whose
module does not import counts through that module's collection error, and every other test failing
in the same run is listed apart: a suite's pre-existing failures (a missing network, an old
dependency) must not outvote the test the user named.

Without named tests the whole suite runs and the failing set is chosen from what fails: the failing
tests in test files changed since the last commit (the test the user just wrote or received) when
there are any, else every failure; a test stopped at its time limit never counts (a hang says nothing
about which line is wrong), nor does a module that does not import unless it was just changed.
"""

from __future__ import annotations

from pathlib import Path

from openglm.swe.testrun import TestRun
from openglm.util.git import git


def named_matches(run: TestRun, named: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(failing set, other failing tests, notes) for tests named by node id, class or file."""
    failed = set(run.failed)
    failing: list[str] = []
    notes: list[str] = []
    for test in named:
        hits = [r for r in run.results if r == test or r.startswith((test + "[", test + "::"))]
        module = test.split("::")[0]
        bad = [r for r in hits if r in failed]
        if bad:
            failing += bad
        elif run.results.get(module, {}).get("outcome") == "collect_error":
            failing.append(module)
            notes.append(f"{test}: its module does not import (the collection error is the evidence)")
        elif hits:
            notes.append(f"{test} passed in this run")
        else:
            notes.append(f"{test} did not run" + (" (the run timed out)" if run.timed_out else ""))
    failing = list(dict.fromkeys(failing))
    return failing, sorted(failed - set(failing)), notes


def changed_test_files(repo: Path) -> set[str]:
    """Files changed since the last commit (modified or untracked), or none outside git."""
    out = git(repo, "status", "--porcelain", "--untracked-files=all", check=False)
    return {line[3:].split(" -> ")[-1].strip('"') for line in out.splitlines() if len(line) > 3}


def choose_failing(run: TestRun, repo: Path) -> tuple[list[str], list[str], list[str]]:
    """(failing set, other failing tests, notes) for a run of the whole suite. A module that does not
    import counts only when it was just changed (a new test importing what the fix will add);
    otherwise it is a collection error, reported as such."""
    timeouts = run.with_outcome("timeout")
    broken = run.with_outcome("collect_error")
    failed = run.with_outcome("failed", "error")
    notes = [f"{len(timeouts)} test(s) stopped at the per-test time limit: not counted"] if timeouts else []
    changed = changed_test_files(repo)
    focus = [t for t in failed + broken if t.split("::")[0] in changed]
    if focus:
        if len(focus) < len(failed):
            notes.append(f"following the {len(focus)} failing test(s) in test files changed since the last "
                         f"commit; {len(failed) - len(focus)} other failing test(s) listed apart")
        return focus, sorted(set(failed) - set(focus)) + timeouts, notes
    return failed, timeouts, notes
