"""Score candidate patches and pick the least destructive one that passes.

Each candidate is tried in a scratch copy of the workspace (the workspace itself is untouched until
the choice is made): applies cleanly, compiles, introduces no new Pyflakes message, its impact
(functions changed + callers + importing modules, from the import/call graph), the target tests
(failing tests + the regression test) and the full suite. Passing = applies, compiles, no new
Pyflakes message, target tests and suite green; among those the lowest impact wins, then the
smallest diff.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex
from openglm.swe.repomap import impact
from openglm.swe.testrun import run_tests
from openglm.swe.verify import compile_check, pyflakes_check
from openglm.util.git import apply_patch

_SCRATCH_IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".venv", "venv", ".pytest_cache", "*.pyc")


def patch_files(patch: str) -> list[str]:
    files = re.findall(r"^\+\+\+ b/(\S+)", patch, re.M)
    return sorted(set(files))


def changed_lines(patch: str) -> dict[str, list[int]]:
    """{file: new-side line numbers the hunks touch}."""
    out: dict[str, list[int]] = {}
    current, line = None, 0
    for text in patch.splitlines():
        if text.startswith("+++ "):
            current = text[6:] if text.startswith("+++ b/") else None
        elif text.startswith("@@") and current:
            m = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", text)
            line = int(m.group(1)) if m else 0
        elif current and text.startswith("+") and not text.startswith("+++"):
            out.setdefault(current, []).append(line)
            line += 1
        elif current and text.startswith("-") and not text.startswith("---"):
            out.setdefault(current, []).append(line)  # a deletion touches the line that follows it
        elif current and not text.startswith("\\"):
            line += 1
    return out


def score_candidate(workspace: Path, patch: str, tests: list[str], suite: bool, timeout: float) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="openglm-cand-")) / "ws"
    shutil.copytree(workspace, scratch, ignore=_SCRATCH_IGNORE, symlinks=True)
    try:
        files = patch_files(patch)
        before = {f: len(pyflakes_check(scratch, [f])) for f in files if (scratch / f).exists()}
        applied, log = apply_patch(scratch, patch)
        s = {"applies": applied, "files": files, "lines_changed": sum(
            1 for t in patch.splitlines() if t[:1] in "+-" and t[:3] not in ("+++", "---"))}
        if not applied:
            return {**s, "passes": False, "why": "patch does not apply: " + log.strip()[-300:]}
        compiled = compile_check(scratch, [f for f in files if f.endswith(".py")])
        s["compiles"] = all(c["ok"] for c in compiled)
        flakes = pyflakes_check(scratch, [c["file"] for c in compiled if c["ok"]])
        s["new_pyflakes"] = [f"{m['file']}:{m['line']}: {m['message']}" for m in flakes
                             if sum(1 for x in flakes if x["file"] == m["file"]) > before.get(m["file"], 0)]
        index = FunctionIndex(scratch)
        changed = {f: sorted({fn.name for ln in lines if (fn := index.function_at(f, ln))})
                   for f, lines in changed_lines(patch).items() if f.endswith(".py")}
        s["impact"] = impact(scratch, changed)
        target = run_tests(scratch, tests, timeout=timeout) if tests else None  # the repository's runner
        s["tests"] = {"ran": tests, "failed": target.failed if target else [],
                      "passed": len(target.passed) if target else 0}
        # every requested test must have run (a test id that matches nothing is not a pass)
        s["tests_pass"] = bool(target and not target.failed and not target.timed_out
                               and all(any(r.startswith(t) for r in target.results) for t in tests))
        if suite and s["tests_pass"]:  # no need to run the suite for a candidate already rejected
            full = run_tests(scratch, [], timeout=timeout)
            s["suite"] = {"passed": len(full.passed), "failed": full.failed[:20]}
            s["suite_pass"] = bool(full.results) and not full.failed and not full.timed_out
        else:
            s["suite_pass"] = None if suite else True
        s["passes"] = bool(s["compiles"] and not s["new_pyflakes"] and s["tests_pass"] and s["suite_pass"])
        if not s["passes"]:
            s["why"] = ", ".join(k for k, bad in [("does not compile", not s["compiles"]),
                                                  ("new Pyflakes messages", bool(s["new_pyflakes"])),
                                                  ("target tests fail", not s["tests_pass"]),
                                                  ("suite fails", s["suite_pass"] is False)] if bad)
        return s
    finally:
        shutil.rmtree(scratch.parent, ignore_errors=True)


def choose(scores: list[dict]) -> int | None:
    """Index of the least destructive passing candidate, or None."""
    passing = [i for i, s in enumerate(scores) if s.get("passes")]
    if not passing:
        return None
    return min(passing, key=lambda i: (scores[i]["impact"]["score"], scores[i]["lines_changed"], i))


def score_and_apply(workspace: str | Path, candidates: list[dict], tests: list[str], suite: bool = True,
                    timeout: float = 600) -> dict:
    workspace = Path(workspace).resolve()
    scores = []
    for i, cand in enumerate(candidates):
        s = score_candidate(workspace, cand.get("patch", ""), tests, suite, timeout)
        scores.append({"index": i, "summary": cand.get("summary", ""), **s})
    chosen = choose(scores)
    result = {"scores": scores, "chosen": chosen}
    if chosen is not None:
        applied, log = apply_patch(workspace, candidates[chosen]["patch"])
        result["applied"] = applied
        if not applied:
            result["chosen"], result["why"] = None, "the chosen patch no longer applies: " + log[-300:]
    return result
