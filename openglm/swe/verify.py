"""`openglm verify`: compile every (changed) Python file, run Pyflakes on it, run the tests
(pytest or unittest) and report per-test results as JSON. The policy scores candidate patches with it."""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass
from pathlib import Path

from openglm.retrieval.spans import python_files
from openglm.swe.testrun import run_pytest, run_unittest
from openglm.util.git import run_git


@dataclass
class VerifyConfig:
    runner: str = "auto"  # auto | pytest | unittest | none
    timeout: float = 900
    pythonpath: list[str] | None = None
    python: str | None = None  # the interpreter the tests run under (the repository's environment)


def changed_python_files(repo: Path) -> list[str] | None:
    """Python files differing from HEAD (tracked changes + untracked), or None outside git."""
    proc = run_git(["status", "--porcelain", "--untracked-files=all"], repo, text=True)
    if not proc.ok:
        return None
    files = []
    for line in proc.stdout.splitlines():
        path = line[3:].split(" -> ")[-1].strip('"')
        if path.endswith(".py") and (repo / path).exists():
            files.append(path)
    return sorted(files)


def compile_check(repo: Path, files: list[str]) -> list[dict]:
    out = []
    for rel in files:
        try:
            compile((repo / rel).read_text(encoding="utf-8", errors="replace"), rel, "exec")
            out.append({"file": rel, "ok": True})
        except SyntaxError as e:
            out.append({"file": rel, "ok": False, "line": e.lineno, "error": f"{e.msg}"})
    return out


def pyflakes_check(repo: Path, files: list[str]) -> list[dict]:
    from pyflakes.api import check  # only when Pyflakes runs
    from pyflakes.reporter import Reporter

    messages = []
    for rel in files:
        out, err = io.StringIO(), io.StringIO()
        check((repo / rel).read_text(encoding="utf-8", errors="replace"), rel, Reporter(out, err))
        for line in (out.getvalue() + err.getvalue()).splitlines():
            parts = line.split(":", 3)
            if len(parts) >= 3 and parts[1].isdigit():
                messages.append({"file": rel, "line": int(parts[1]), "message": parts[-1].strip()})
    return messages


def detect_runner() -> str:
    """pytest (which also runs unittest suites) when it is installed, else unittest."""
    return "pytest" if importlib.util.find_spec("pytest") else "unittest"


def verify(repo: str | Path, files: list[str] | None = None, tests: list[str] = (),
           config: VerifyConfig | None = None) -> dict:
    config = config or VerifyConfig()
    repo = Path(repo).resolve()
    if files is None:
        files = changed_python_files(repo)
        if files is None:
            files = [p.relative_to(repo).as_posix() for p in python_files(repo)]
    compiled = compile_check(repo, files)
    flakes = pyflakes_check(repo, [c["file"] for c in compiled if c["ok"]])
    result = {"repo": str(repo), "files": files, "compile": compiled, "pyflakes": flakes}
    runner = detect_runner() if config.runner == "auto" else config.runner
    if runner != "none":
        if runner == "unittest":
            run = run_unittest(repo, list(tests), python=config.python, pythonpath=config.pythonpath,
                               timeout=config.timeout)
        else:
            run = run_pytest(repo, list(tests), python=config.python, pythonpath=config.pythonpath,
                             timeout=config.timeout)
        result["tests"] = {
            "runner": runner, "returncode": run.returncode, "timed_out": run.timed_out,
            "passed": len(run.passed), "failed": run.failed,
            "collection_errors": run.with_outcome("collect_error"), "timeouts": run.with_outcome("timeout"),
            "results": {n: r["outcome"] for n, r in sorted(run.results.items())},
            "failures": {n: run.results[n]["longrepr"][-3000:] for n in run.failed},
        }
        if not run.results:
            result["tests"]["output_tail"] = run.output[-3000:]
    tests_ok = runner == "none" or (bool(result["tests"]["results"]) and not result["tests"]["failed"]
                                    and not result["tests"]["timed_out"])
    result["ok"] = all(c["ok"] for c in compiled) and tests_ok
    result["pyflakes_clean"] = not flakes
    return result
