"""Run a project's tests in a subprocess and collect per-test outcomes (and optionally coverage).

pytest runs with our plugin (`_pytest_plugin`) so results are keyed by node id without parsing the
console; unittest runs with `-v` and its log is parsed. Both are used by verify, localize and the
benchmark generator.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from openglm.swe.logparse import parse_unittest_log
from openglm.util import proc

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # makes `openglm` importable in the child


@dataclass
class TestRun:
    results: dict[str, dict] = field(default_factory=dict)  # nodeid -> {"outcome", "longrepr"}
    output: str = ""
    returncode: int = 0
    coverage_file: str | None = None
    timed_out: bool = False

    @property
    def failed(self) -> list[str]:
        return sorted(n for n, r in self.results.items() if r["outcome"] in ("failed", "error"))

    @property
    def passed(self) -> list[str]:
        return sorted(n for n, r in self.results.items() if r["outcome"] == "passed")


def source_paths(repo: Path, pythonpath: list[str] | None = None) -> list[str]:
    """Directories to put on sys.path: the given ones, else `src/` when the project uses that layout."""
    if pythonpath is not None:
        return [str((repo / p).resolve()) for p in pythonpath]
    return [str((repo / "src").resolve())] if (repo / "src").is_dir() else [str(repo.resolve())]


_PYTEST_SECTIONS = {"pytest.ini": "", "pyproject.toml": "[tool.pytest.ini_options]", "tox.ini": "[pytest]",
                    "setup.cfg": "[tool:pytest]"}


def pytest_config_args(repo: Path) -> list[str]:
    """Pin pytest's rootdir to the repo. Without a pytest config of its own, pytest would climb to
    an enclosing project's config (e.g. a checkout under openglm's tree would pick up openglm's
    pyproject.toml), so such repos get an empty config file instead."""
    for name, section in _PYTEST_SECTIONS.items():
        p = repo / name
        if p.is_file() and (not section or section in p.read_text(errors="replace")):
            return ["--rootdir", str(repo)]
    global _EMPTY_INI
    if _EMPTY_INI is None or not Path(_EMPTY_INI).exists():
        folder = tempfile.mkdtemp(prefix="openglm-pytest-")
        atexit.register(shutil.rmtree, folder, True)
        _EMPTY_INI = str(Path(folder) / "pytest.ini")
        Path(_EMPTY_INI).write_text("[pytest]\n")
    return ["-c", _EMPTY_INI, "--rootdir", str(repo)]


_EMPTY_INI: str | None = None


def child_env(repo: Path, pythonpath: list[str] | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    paths = source_paths(repo, pythonpath) + [PACKAGE_ROOT]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def _run_into(run: TestRun, cmd: list[str], repo: Path, env: dict, timeout: float) -> None:
    """Run `cmd` in `repo`, recording its combined output and exit status (-9 on timeout: the test run
    and everything it started are killed) in `run`."""
    result = proc.run(cmd, cwd=repo, env=env, timeout=timeout, merge_stderr=True)
    run.output, run.timed_out = result.stdout, result.timed_out
    run.returncode = -9 if result.timed_out else result.returncode


def run_pytest(repo: str | Path, targets: list[str], *, python: str = sys.executable,
               pythonpath: list[str] | None = None, coverage_source: list[str] | None = None,
               timeout: float = 600, extra_args: list[str] | None = None) -> TestRun:
    """Run `pytest targets` in `repo`; with coverage_source, record per-test line coverage."""
    repo = Path(repo)
    tmp = Path(tempfile.mkdtemp(prefix="openglm-tests-"))
    results_file = tmp / "results.json"
    extra = {"OPENGLM_RESULTS": str(results_file)}
    run = TestRun()
    if coverage_source is not None:
        run.coverage_file = str(tmp / ".coverage")
        extra["OPENGLM_COV_DATA"] = run.coverage_file
        extra["OPENGLM_COV_SOURCE"] = os.pathsep.join(str((repo / s).resolve()) for s in coverage_source)
    # addopts= and no cacheprovider: the project's own pytest options (coverage plugins, -x...)
    # must not change what runs, and nothing is written into the checkout.
    cmd = [python, "-m", "pytest", "-p", "openglm.swe._pytest_plugin", "-p", "no:cacheprovider",
           *pytest_config_args(repo.resolve()), "-o", "addopts=", "-q", "--tb=short", "-rN",
           *(extra_args or []), *targets]
    _run_into(run, cmd, repo, child_env(repo, pythonpath, extra), timeout)
    if results_file.exists():
        run.results = json.loads(results_file.read_text())
    return run


def run_unittest(repo: str | Path, targets: list[str], *, python: str = sys.executable,
                 pythonpath: list[str] | None = None, timeout: float = 600) -> TestRun:
    """Run `python -m unittest -v targets` (discovery when no target) and parse the verbose log."""
    repo = Path(repo)
    # `unittest -v discover` would load a test named "discover": discovery takes its options after it
    cmd = [python, "-m", "unittest", "-v", *targets] if targets else [python, "-m", "unittest", "discover", "-v"]
    run = TestRun()
    _run_into(run, cmd, repo, child_env(repo, pythonpath), timeout)
    for name, status in parse_unittest_log(run.output).items():
        outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error"}.get(status, "skipped")
        run.results[name] = {"outcome": outcome, "longrepr": ""}
    return run


def per_test_lines(coverage_file: str) -> dict[str, dict[str, set[int]]]:
    """{file: {nodeid: executed lines}} from a coverage data file recorded by the plugin."""
    import coverage  # optional: only to read per-test coverage

    data = coverage.CoverageData(basename=coverage_file)
    data.read()
    out: dict[str, dict[str, set[int]]] = {}
    for path in data.measured_files():
        by_test: dict[str, set[int]] = {}
        for line, contexts in data.contexts_by_lineno(path).items():
            for ctx in contexts:
                if ctx:  # the empty context is import time, outside any test
                    by_test.setdefault(ctx, set()).add(line)
        out[path] = by_test
    return out


# ---- the repository's own runner ------------------------------------------------------------------
_PYTEST_MARKS = ("import pytest", "from pytest", "@pytest.", "pytest.fixture")


def repo_runner(repo: str | Path) -> str:
    """The runner the repository's tests are written for: "pytest" when it configures pytest (a pytest
    config section, conftest.py) or its tests use it; "unittest" when its tests are unittest suites only
    (or pytest is not installed); "pytest" otherwise."""
    repo = Path(repo)
    if importlib.util.find_spec("pytest") is None:
        return "unittest"
    if any((repo / n).is_file() and (not s or s in (repo / n).read_text(errors="replace"))
           for n, s in _PYTEST_SECTIONS.items()) or (repo / "conftest.py").is_file():
        return "pytest"
    uses_unittest = False
    for path in _test_files(repo):
        text = path.read_text(errors="replace")
        if path.name == "conftest.py" or any(m in text for m in _PYTEST_MARKS):
            return "pytest"
        uses_unittest = uses_unittest or "unittest" in text
    return "unittest" if uses_unittest else "pytest"


def _test_files(repo: Path, limit: int = 500):
    skip = {".git", ".venv", "venv", "node_modules", "__pycache__", ".tox", "build", "dist"}
    n = 0
    for path in sorted(repo.rglob("*.py")):
        if skip.intersection(path.relative_to(repo).parts):
            continue
        if path.name.startswith("test") or path.name.endswith("_test.py") or path.name == "conftest.py":
            yield path
            n += 1
            if n >= limit:
                return


def run_tests(repo: str | Path, targets: list[str], *, runner: str = "auto", timeout: float = 600,
              python: str = sys.executable) -> TestRun:
    """Run `targets` (pytest node ids, `path.py::Class::test`; none: the whole suite) with the
    repository's runner. Results are keyed by node id whichever runner ran them."""
    repo = Path(repo)
    runner = repo_runner(repo) if runner == "auto" else runner
    if runner == "pytest":
        return run_pytest(repo, targets, python=python, timeout=timeout)
    run = run_unittest(repo, [unittest_name(t) for t in targets], python=python, timeout=timeout)
    run.results = {node_id(repo, name): r for name, r in run.results.items()}
    return run


def unittest_name(target: str) -> str:
    """`tests/test_x.py::TestX::test_y` -> `tests.test_x.TestX.test_y` (unittest's dotted name)."""
    path, _, rest = target.partition("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", ".").replace(os.sep, "."), *filter(None, rest.split("::"))])


def node_id(repo: Path, name: str) -> str:
    """unittest's `test_y (tests.test_x.TestX.test_y)` -> `tests/test_x.py::TestX::test_y`."""
    method, _, where = name.partition(" (")
    parts = where.rstrip(")").split(".") if where else [method]
    if parts[-1] != method:
        parts.append(method)  # Python < 3.11 prints only the class in parentheses
    for i in range(len(parts) - 1, 0, -1):
        file = "/".join(parts[:i]) + ".py"
        if (repo / file).is_file():
            return "::".join([file, *parts[i:]])
    return name
