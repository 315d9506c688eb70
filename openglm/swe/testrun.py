"""Run a project's tests in a subprocess and collect per-test outcomes (and optionally coverage).

pytest runs with our plugin (`_pytest_plugin`) so results are keyed by node id without parsing the
console; unittest runs with `-v` and its log is parsed. Both are used by verify, localize and the
benchmark generator.

Tests run under an interpreter of the caller's choice (`--python` / `--venv`: the repository's own
environment, its pytest included); only the plugin (and coverage.py, when the interpreter lacks it)
come from openglm, through a small folder of links on PYTHONPATH, so nothing else of openglm's
environment shadows the repository's packages. Every run's temporary files are removed when it ends.
"""

from __future__ import annotations

import atexit
import configparser
import fnmatch
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from openglm.swe.logparse import parse_unittest_log
from openglm.util import proc

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the `openglm` package
FAILED_OUTCOMES = ("failed", "error", "collect_error", "timeout")


def run_command(cmd: list[str] | str, cwd: str | Path, *, env: dict | None = None, timeout: float | None = None,
                input: str | None = None, shell: bool = False) -> tuple[int, str, bool]:
    """`proc.run` in the shape the test runners use: (exit status, stdout+stderr, timed out?); on timeout
    the whole process group is killed (a test suite's children too) and the status is -9."""
    result = proc.run(["sh", "-c", cmd] if shell else cmd, cwd=cwd, env=env, input=input, timeout=timeout,
                      merge_stderr=True)
    return (-9 if result.timed_out else result.returncode), result.stdout, result.timed_out


class InterpreterError(ValueError):
    """--python / --venv names no usable interpreter."""


def resolve_python(python: str | None = None, venv: str | Path | None = None) -> str:
    """The interpreter tests run under: `python`, else `venv`'s, else $OPENGLM_TEST_PYTHON, else openglm's own."""
    if python and venv:
        raise InterpreterError("give --python or --venv, not both")
    if venv:
        exe = Path(venv) / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        if not exe.exists():
            raise InterpreterError(f"--venv {venv}: no {exe.relative_to(venv)} in it (not a virtualenv?)")
        return str(exe)
    python = python or os.environ.get("OPENGLM_TEST_PYTHON") or sys.executable
    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if not found:
        raise InterpreterError(f"--python {python}: not an executable interpreter")
    return found


@dataclass
class TestRun:
    results: dict[str, dict] = field(default_factory=dict)  # nodeid -> {"outcome", "longrepr"}
    output: str = ""
    returncode: int = 0
    coverage_file: str | None = None
    timed_out: bool = False
    tmp: str | None = None  # the run's folder (results, coverage); removed by close()

    @property
    def failed(self) -> list[str]:
        """Tests that did not pass: failed, errored, timed out, or whose module did not import."""
        return sorted(n for n, r in self.results.items() if r["outcome"] in FAILED_OUTCOMES)

    @property
    def passed(self) -> list[str]:
        return sorted(n for n, r in self.results.items() if r["outcome"] == "passed")

    def with_outcome(self, *outcomes: str) -> list[str]:
        return sorted(n for n, r in self.results.items() if r["outcome"] in outcomes)

    def close(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp, self.coverage_file = None, None

    def __enter__(self) -> TestRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def source_paths(repo: Path, pythonpath: list[str] | None = None) -> list[str]:
    """Directories to put on sys.path: the given ones, else `src/` when the project uses that layout."""
    if pythonpath is not None:
        return [str((repo / p).resolve()) for p in pythonpath]
    return [str((repo / "src").resolve())] if (repo / "src").is_dir() else [str(repo.resolve())]


_PYTEST_SECTIONS = {"pytest.ini": "", "pyproject.toml": "[tool.pytest.ini_options]", "tox.ini": "[pytest]",
                    "setup.cfg": "[tool:pytest]"}
# Test modules of a repository without a pytest configuration: pytest's default names widened to
# the `tests.py` / `tests_*.py` / `*_tests.py` names that nose and unittest suites also use.
DEFAULT_TEST_FILES = ("test*.py", "*_test.py", "*_tests.py")


def pytest_config_file(repo: Path) -> Path | None:
    """The file holding the repository's pytest configuration, if it has one."""
    for name, section in _PYTEST_SECTIONS.items():
        p = repo / name
        if p.is_file() and (not section or section in p.read_text(errors="replace")):
            return p
    return None


def _config_value(config: Path, key: str) -> str | list | None:
    """A key of the repository's pytest section (pyproject.toml, or an ini-style file); None if absent
    or unreadable."""
    try:
        if config.name == "pyproject.toml":
            import tomllib  # only for pyproject.toml configurations

            return tomllib.loads(config.read_text()).get("tool", {}).get("pytest", {}).get(
                "ini_options", {}).get(key)
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(config.read_text(errors="replace"))
        section = _PYTEST_SECTIONS[config.name].strip("[]") or "pytest"
        return parser.get(section, key, fallback=None)
    except (ValueError, configparser.Error, OSError):
        return None


def test_file_patterns(repo: Path | None) -> tuple[str, ...]:
    """The names of the repository's test modules: its pytest `python_files`, pytest's default when
    it configures pytest without them, DEFAULT_TEST_FILES when it does not configure pytest."""
    config = pytest_config_file(repo) if repo is not None else None
    if config is None:
        return DEFAULT_TEST_FILES
    value = _config_value(config, "python_files")
    if isinstance(value, str):
        value = value.split()
    return tuple(value) if value else ("test_*.py", "*_test.py")


def is_test_module(rel: str, repo: Path | None = None) -> bool:
    """Is `rel` (a repo-relative path) a test module pytest would collect in `repo`?"""
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, pattern) for pattern in test_file_patterns(repo))


def _default_ini() -> str:
    """A pytest.ini naming DEFAULT_TEST_FILES, written once per process and removed at exit."""
    global _DEFAULT_INI
    if _DEFAULT_INI is None or not Path(_DEFAULT_INI).exists():
        folder = tempfile.mkdtemp(prefix="openglm-pytest-")
        atexit.register(shutil.rmtree, folder, True)
        _DEFAULT_INI = str(Path(folder) / "pytest.ini")
        Path(_DEFAULT_INI).write_text("[pytest]\npython_files = " + " ".join(DEFAULT_TEST_FILES) + "\n")
    return _DEFAULT_INI


_DEFAULT_INI: str | None = None


def pytest_config_args(repo: Path) -> list[str]:
    """Pin pytest's rootdir to the repo; its own configuration decides discovery. Without one, pytest
    would climb to an enclosing project's config (a checkout under openglm's tree would pick up
    openglm's pyproject.toml), so such repos get a config naming DEFAULT_TEST_FILES instead."""
    if pytest_config_file(repo) is not None:
        return ["--rootdir", str(repo)]
    return ["-c", _default_ini(), "--rootdir", str(repo)]


def _tool_path() -> str:
    """A folder on the child's PYTHONPATH with links to the `openglm` package (the plugin) and, when
    needed, to coverage.py: just those, so openglm's own pytest and libraries never shadow the
    repository's. Made once per process, removed at exit."""
    global _TOOLS
    if _TOOLS is None or not Path(_TOOLS).exists():
        _TOOLS = tempfile.mkdtemp(prefix="openglm-tools-")
        atexit.register(shutil.rmtree, _TOOLS, True)
        os.symlink(Path(PACKAGE_ROOT) / "openglm", Path(_TOOLS) / "openglm")
        spec = importlib.util.find_spec("coverage")
        if spec and spec.submodule_search_locations:
            os.symlink(list(spec.submodule_search_locations)[0], Path(_TOOLS) / "coverage")
    return _TOOLS


_TOOLS: str | None = None


def child_env(repo: Path, pythonpath: list[str] | None = None, extra: dict | None = None) -> dict:
    """The test run's environment: the repo's source first on sys.path, then the plugin's folder (its
    coverage.py, whose data files openglm reads back), then the caller's PYTHONPATH."""
    env = dict(os.environ)
    paths = source_paths(repo, pythonpath) + [_tool_path()]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def _run_into(run: TestRun, cmd: list[str], repo: Path, env: dict, timeout: float) -> None:
    """Run `cmd` in `repo`, recording its combined output and exit status (-9 on timeout: the test run
    and everything it started are killed) in `run`."""
    run.returncode, run.output, run.timed_out = run_command(cmd, repo, env=env, timeout=timeout)


def read_results(path: Path) -> dict[str, dict]:
    """The plugin's JSON-lines file -> {nodeid: {"outcome", "longrepr"}} (a line cut by a kill is skipped)."""
    results: dict[str, dict] = {}
    if not path.exists():
        return results
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        results[rec.pop("nodeid")] = rec
    return results


def run_pytest(repo: str | Path, targets: list[str], *, python: str | None = None,
               pythonpath: list[str] | None = None, coverage_source: list[str] | None = None,
               timeout: float = 600, test_timeout: float = 0, extra_args: list[str] | None = None) -> TestRun:
    """Run `pytest targets` in `repo`; with coverage_source, record per-test line coverage (the caller
    reads it, then closes the run). A module that fails to import does not stop the others. `timeout`
    is the run's budget: no test starts after it, and the process group is killed a minute later;
    `test_timeout` stops one test that runs longer (outcome `timeout`)."""
    repo = Path(repo)
    python = resolve_python(python)
    run = TestRun(tmp=tempfile.mkdtemp(prefix="openglm-tests-"))
    results_file = Path(run.tmp) / "results.jsonl"
    extra = {"OPENGLM_RESULTS": str(results_file), "OPENGLM_DEADLINE": str(time.time() + timeout)}
    if test_timeout:
        extra["OPENGLM_TEST_TIMEOUT"] = str(test_timeout)
    coverage_args = []
    if coverage_source is not None:
        run.coverage_file = str(Path(run.tmp) / ".coverage")
        extra["OPENGLM_COV_DATA"] = run.coverage_file
        extra["OPENGLM_COV_SOURCE"] = os.pathsep.join(str((repo / s).resolve()) for s in coverage_source)
        # passing plain `assert`s start new coverage segments (pytest >= 5; older ones ignore the key)
        coverage_args = ["-o", "enable_assertion_pass_hook=true"]
    # addopts= and no cacheprovider: the project's own pytest options (coverage plugins, -x...)
    # must not change what runs, and nothing is written into the checkout.
    cmd = [python, "-m", "pytest", "-p", "openglm.swe._pytest_plugin", "-p", "no:cacheprovider",
           *pytest_config_args(repo.resolve()), "-o", "addopts=", "-q", "--tb=short",
           "--continue-on-collection-errors", *coverage_args, *(extra_args or []), *targets]
    _run_into(run, cmd, repo, child_env(repo, pythonpath, extra), timeout + KILL_GRACE_S)
    run.results = read_results(results_file)
    if coverage_source is None:
        run.close()
    return run


KILL_GRACE_S = 60  # after the budget, the test running then may finish and coverage be saved


def run_unittest(repo: str | Path, targets: list[str], *, python: str | None = None,
                 pythonpath: list[str] | None = None, timeout: float = 600) -> TestRun:
    """Run `python -m unittest -v targets` (discovery when no target) and parse the verbose log."""
    repo = Path(repo)
    # `unittest -v discover` would load a test named "discover": discovery takes its options after it
    cmd = [python, "-m", "unittest", "-v", *targets] if targets else [python, "-m", "unittest", "discover", "-v"]
    run = TestRun()
    _run_into(run, [resolve_python(python), *cmd[1:]], repo, child_env(repo, pythonpath), timeout)
    for name, status in parse_unittest_log(run.output).items():
        outcome = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error"}.get(status, "skipped")
        run.results[name] = {"outcome": outcome, "longrepr": ""}
    return run


def per_segment_lines(coverage_file: str) -> dict[str, dict[tuple[str, int], set[int]]]:
    """{file: {(nodeid, segment): executed lines}} from a coverage data file recorded by the plugin
    (segment k: what ran after the test's k-th passing assertion). Import time (the empty context)
    and failure-reporting code (`<nodeid>|report`) belong to no test."""
    import coverage  # optional: only to read per-test coverage

    from openglm.swe._pytest_plugin import REPORT_SUFFIX  # the plugin names its contexts

    data = coverage.CoverageData(basename=coverage_file)
    data.read()
    out: dict[str, dict[tuple[str, int], set[int]]] = {}
    names: dict[str, tuple[str, int]] = {}
    for path in data.measured_files():
        by_unit: dict[tuple[str, int], set[int]] = {}
        for line, contexts in data.contexts_by_lineno(path).items():
            for ctx in contexts:
                if not ctx or ctx.endswith(REPORT_SUFFIX):
                    continue
                if ctx not in names:
                    test, _, seg = ctx.rpartition("|")
                    names[ctx] = (test, int(seg)) if test and seg.isdigit() else (ctx, 0)
                by_unit.setdefault(names[ctx], set()).add(line)
        out[path] = by_unit
    return out


def per_test_lines(coverage_file: str) -> dict[str, dict[str, set[int]]]:
    """{file: {nodeid: executed lines}}: per_segment_lines with each test's segments merged."""
    out: dict[str, dict[str, set[int]]] = {}
    for path, by_unit in per_segment_lines(coverage_file).items():
        by_test: dict[str, set[int]] = {}
        for (test, _), lines in by_unit.items():
            by_test.setdefault(test, set()).update(lines)
        out[path] = by_test
    return out


# ---- the repository's own runner ------------------------------------------------------------------
_PYTEST_MARKS = ("import pytest", "from pytest", "@pytest.", "pytest.fixture")


def repo_runner(repo: str | Path) -> str:
    """The runner the repository's tests are written for: "pytest" when it configures pytest (a pytest
    config section, conftest.py) or its tests use it; "unittest" when its tests are unittest suites only
    (or pytest is not installed) that `unittest discover` can find (in packages); "pytest" otherwise."""
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
        if not _in_packages(repo, path):
            return "pytest"  # `unittest discover` finds test modules only inside packages
        uses_unittest = uses_unittest or "unittest" in text
    return "unittest" if uses_unittest else "pytest"


def _in_packages(repo: Path, path: Path) -> bool:
    """Is every folder between the repository root and `path` a package (has an __init__.py)?"""
    return all((repo.joinpath(*path.relative_to(repo).parts[:i]) / "__init__.py").is_file()
               for i in range(1, len(path.relative_to(repo).parts)))


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
              python: str | None = None) -> TestRun:
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
