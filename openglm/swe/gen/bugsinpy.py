"""Real-bug instances from BugsInPy, in SWE-bench format, checked to reproduce on this Python.

BugsInPy (github.com/soarsmu/BugsInPy) records, per bug of a project, the buggy and fixed commits, the
tests that expose the bug (`run_test.sh`), the test files and pinned requirements. The builder reads a
local checkout of that repository and local clones of the projects (`repos_dir/owner__name`, the
layout the harness uses) and, per bug:

1. the gold `patch` is the fix (buggy -> fixed) of the files BugsInPy's `bug_patch.txt` names, the
   `test_patch` the same diff of the test files (test modules and their data);
2. the tests of `run_test.sh` (pytest node ids or unittest dotted names) become pytest node ids;
3. the requirements are installed in a shared dependency environment (`harness.env.dependency_env`):
   pins that do not install on this Python are relaxed one at a time (the pin dropped, then the
   package), and the environment's pytest is probed: `--assert=plain` when its assertion rewriting
   cannot handle this Python, a later pytest when it cannot run at all;
4. the instance is graded by the harness itself, empty patch and gold patch: every named test must
   fail without the fix and pass with it; FAIL_TO_PASS are the named tests, PASS_TO_PASS the tests
   of the run passing on both sides. A bug that does not reproduce is skipped with the reason.

Each bug's outcome is cached (`out_dir/bugs/<id>.v<N>.json`), so a rerun builds only what is new.
`openglm_bug` records where the fix is (files, functions, buggy lines) for the localisation benchmark.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import venv
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from openglm.retrieval.spans import functions_in_source, is_test_path
from openglm.swe.harness.env import EnvBuildError, dependency_env, pip_install, source_repo
from openglm.swe.harness.run import HarnessConfig, Sandbox, pytest_command
from openglm.swe.logparse import parse_log, test_passed
from openglm.swe.testrun import run_command
from openglm.util.files import write_atomic
from openglm.util.git import GitError, git

BUILDER_VERSION = 1  # bump when the rules change, so cached per-bug outcomes are not reused
MAX_IMPORT_RELAXES = 8  # pins unpinned per bug because their code fails to import on this Python
MODULE = "<module>"  # the "function" of a line outside any function (a module-level statement)
# pytest releases tried, in order, when the pinned one cannot run on this Python at all
PYTEST_FALLBACKS = ("pytest==4.6.11", "pytest==6.2.5", "pytest==7.4.4")
# how the project itself is installed when BugsInPy installs it (generated files such as black's
# _black_version.py, entry points): into the instance venv, with the dependency environment's tools
INSTALL_CMD = "pip install --no-deps --no-build-isolation --no-input -e ."
# an import of what Python 3.10/3.11 removed from the standard library (harness/stdlib_compat.py)
REMOVED_STDLIB = re.compile(r"cannot import name '\w+' from '(?:inspect|collections)'"
                            r"|module '(?:inspect|collections)' has no attribute")
# requirement lines that name no installable distribution (an Ubuntu pip artefact)
_NOT_INSTALLABLE = {"pkg-resources"}


class NotReproducible(RuntimeError):
    """The bug cannot be graded here; the message says why (`output`: the test run's, when one ran)."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


@dataclass
class BugsInPyConfig:
    bugsinpy_dir: Path  # a checkout of soarsmu/BugsInPy
    repos_dir: Path  # local clones of the projects, named owner__name
    out_dir: Path = Path(".bench/bugsinpy")
    projects: tuple[str, ...] = ()  # BugsInPy project names; default: every project
    bugs: tuple[str, ...] = ()  # instance ids (`thefuck-5`); default: every bug of the projects
    timeout: float = 900  # seconds for one graded test run
    env_timeout: float = 1800  # seconds for one pip install

    @property
    def envs_dir(self) -> Path:
        return self.out_dir / "envs"


@dataclass
class Bug:
    project: str
    number: int
    repo: str  # owner/name
    buggy: str
    fixed: str
    test_files: list[str]
    commands: list[str]  # run_test.sh lines
    requirements: list[str]  # requirements.txt lines + setup.sh installs
    fix_files: list[str]  # the files bug_patch.txt changes
    install: bool = False  # BugsInPy installs the project itself (setup.sh, or an `-e` requirement)

    @property
    def instance_id(self) -> str:
        return f"{self.project}-{self.number}"


# ---- reading BugsInPy ---------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    """BugsInPy's files are UTF-8, some requirements files UTF-16 (with a byte-order mark)."""
    if not path.exists():
        return ""
    data = path.read_bytes()
    return data.decode("utf-16") if data[:2] in (b"\xff\xfe", b"\xfe\xff") else data.decode("utf-8", "replace")


def _info(path: Path) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r'^\s*(\w+)\s*=\s*"([^"]*)"', _read_text(path), re.M)}


def github_repo(url: str) -> str:
    """`https://github.com/nvbn/thefuck/` -> `nvbn/thefuck`."""
    m = re.search(r"github\.com[/:]([^/\s]+)/([^/\s]+?)(?:\.git)?/?$", url.strip())
    if not m:
        raise ValueError(f"not a GitHub repository URL: {url!r}")
    return f"{m[1]}/{m[2]}"


def read_bug(bugsinpy_dir: Path, project: str, number: int) -> Bug:
    root = bugsinpy_dir / "projects" / project
    folder = root / "bugs" / str(number)
    info, meta = _info(folder / "bug.info"), _info(root / "project.info")
    missing = [k for k in ("buggy_commit_id", "fixed_commit_id") if k not in info]
    if missing or "github_url" not in meta:
        raise ValueError(f"{folder}: bug.info / project.info lack {missing or ['github_url']}")
    requirements = _read_text(folder / "requirements.txt").splitlines()
    setup = _read_text(folder / "setup.sh").splitlines()
    requirements += [r for line in setup for r in _setup_installs(line)]
    patch = _read_text(folder / "bug_patch.txt")
    install = any(re.search(r"setup\.py (?:install|develop)|pip3? install (?:-e )?\.", line) for line in setup) \
        or any(line.startswith("-e ") and "#egg=" in line for line in requirements)
    return Bug(install=install, project=project, number=number, repo=github_repo(meta["github_url"]),
               buggy=info["buggy_commit_id"], fixed=info["fixed_commit_id"],
               test_files=[f for f in info.get("test_file", "").split(";") if f],
               commands=[c for c in _read_text(folder / "run_test.sh").splitlines() if c.strip()],
               requirements=requirements,
               fix_files=sorted(set(re.findall(r"^diff --git a/\S+ b/(\S+)", patch, re.M))))


def _setup_installs(line: str) -> list[str]:
    """`pip3 install nose pytest==3.10.1` in setup.sh -> the named packages (not `-e .`, not options)."""
    m = re.match(r"^\s*(?:pip3?|python3? -m ?pip) install (.*)$", line)
    if not m:
        return []
    words = m.group(1).split()
    return [w for w in words if not w.startswith("-") and w not in (".", "..") and not w.startswith((".[", "./"))
            and "-e" not in words]


def list_bugs(config: BugsInPyConfig) -> list[Bug]:
    projects_dir = config.bugsinpy_dir / "projects"
    if not projects_dir.is_dir():
        raise SystemExit(f"{config.bugsinpy_dir} is not a BugsInPy checkout (no projects/ folder)")
    projects = config.projects or tuple(sorted(p.name for p in projects_dir.iterdir() if p.is_dir()))
    unknown = [p for p in projects if not (projects_dir / p / "bugs").is_dir()]
    if unknown:
        raise SystemExit(f"unknown BugsInPy project(s) {unknown}")
    bugs = []
    for project in projects:
        numbers = sorted(int(p.name) for p in (projects_dir / project / "bugs").iterdir() if p.name.isdigit())
        bugs += [read_bug(config.bugsinpy_dir, project, n) for n in numbers]
    if config.bugs:
        wanted = set(config.bugs)
        bugs = [b for b in bugs if b.instance_id in wanted]
    return bugs


# ---- tests and patches --------------------------------------------------------------------------------
def node_ids(commands: list[str], files: set[str]) -> list[str]:
    """The tests `run_test.sh` runs, as pytest node ids: pytest-style targets are kept, unittest's
    dotted names (`tests.test_x.TestX.test_y`) are split where the module file exists (`files`: the
    repository's files at the fixed commit)."""
    out = []
    for line in commands:
        for cmd in re.split(r"\s*(?:&&|;)\s*", line):
            words = cmd.split()
            if "unittest" in words:
                out += [_dotted_to_node(w, files) for w in words[words.index("unittest") + 1:]
                        if not w.startswith("-")]
            else:
                out += [w for w in words if ".py" in w and not w.startswith("-")]
    return list(dict.fromkeys(out))


def _dotted_to_node(name: str, files: set[str]) -> str:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if path in files:
            return "::".join([path, *parts[i:]])
    raise NotReproducible(f"unittest name {name} names no module of the repository")


def fix_patches(repo: Path, bug: Bug) -> tuple[str, str]:
    """(gold patch, test patch) from the buggy..fixed diff: the fix's files and the test files."""
    changed = git(repo, "diff", "--name-only", "--no-renames", bug.buggy, bug.fixed).split("\n")
    changed = [f for f in changed if f]
    tests = [f for f in changed if is_test_path(f) or f in bug.test_files]
    fix = [f for f in bug.fix_files if f in changed and f not in tests]
    if not fix:
        raise NotReproducible("the fix changes no file outside the tests")

    def diff(paths):
        return git(repo, "diff", "--binary", "--no-renames", "--full-index", bug.buggy, bug.fixed, "--", *paths) \
            if paths else ""

    return diff(fix), diff(tests)


def buggy_locations(repo: Path, commit: str, patch: str) -> dict[str, list[str]]:
    """Where the fix is, in the buggy tree: the lines it removes or changes (for a pure insertion, the
    lines around it), their functions (innermost; `file::<module>` outside any) and files."""
    lines: dict[str, set[int]] = {}
    for rel, hunk_lines in _hunk_old_lines(patch).items():
        lines.setdefault(rel, set()).update(hunk_lines)
    out = {"files": sorted(lines), "functions": [], "lines": []}
    functions = set()
    for rel, numbers in sorted(lines.items()):
        try:
            source = git(repo, "show", f"{commit}:{rel}")
        except GitError:
            continue  # a file the fix creates
        spans = functions_in_source(source, rel)
        for n in sorted(numbers):
            out["lines"].append(f"{rel}:{n}")
            inner = [f for f in spans if f.start_line <= n <= f.end_line]
            functions.add(max(inner, key=lambda f: f.start_line).key if inner else f"{rel}::{MODULE}")
    out["functions"] = sorted(functions)
    return out


def _hunk_old_lines(patch: str) -> dict[str, set[int]]:
    """{file: old-side line numbers a patch removes; for lines only added (not replacing removed
    ones), the old lines before and after the insertion point}."""
    out: dict[str, set[int]] = {}
    rel, old, pending_add = None, 0, False
    for line in patch.splitlines():
        if line.startswith("diff --git"):
            rel = None
        elif line.startswith("--- "):
            rel = line[6:] if line.startswith("--- a/") else None
        elif line.startswith("@@") and rel:
            old = int(re.match(r"@@ -(\d+)", line)[1])
            pending_add = False
        elif rel and line.startswith("-") and not line.startswith("---"):
            out.setdefault(rel, set()).add(old)
            old += 1
            pending_add = True  # added lines right after removed ones replace them: no neighbours
        elif rel and line.startswith("+") and not line.startswith("+++"):
            if not pending_add:
                out.setdefault(rel, set()).update(n for n in (old - 1, old) if n > 0)
                pending_add = True
        elif rel and line.startswith(" "):
            old += 1
            pending_add = False
    return out


# ---- the environment ------------------------------------------------------------------------------------
def _name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def clean_requirements(bug: Bug) -> list[str]:
    """The bug's requirements without the project itself (its source comes from the checkout), editable
    or VCS lines and entries that name no distribution; pytest added when none is pinned. None at all:
    the instance runs over the harness's own packages."""
    own = {bug.project.lower().replace("_", "-"), bug.repo.split("/")[-1].lower().replace("_", "-")}
    out: dict[str, str] = {}
    for line in bug.requirements:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or "git+" in line or "://" in line:
            continue
        name = _name(line)
        if name in own or name in _NOT_INSTALLABLE:
            continue
        if name not in out or "==" in line:  # a pin wins over a bare setup.sh install of the same package
            out[name] = line
    if out and "pytest" not in out:
        out["pytest"] = "pytest"
    if bug.install:  # `pip install -e .` without build isolation uses the environment's build tools
        out.setdefault("wheel", "wheel")
    return sorted(out.values(), key=str.lower)


def failing_requirement(log: str, requirements: list[str]) -> str | None:
    """The requirement pip's log blames for a failed install, if it names one of `requirements`."""
    by_name = {_name(r): r for r in requirements}
    patterns = [r"No matching distribution found for ([\w.\-]+)",
                r"Could not find a version that satisfies the requirement ([\w.\-]+)",
                r"Failed to build installable wheels for some pyproject\.toml based projects \(([\w.\-]+)",
                r"Failed to build ([\w.\-]+)", r"Failed building wheel for ([\w.\-]+)",
                r"Running setup\.py install for ([\w.\-]+)\.\.\. error",
                r"The user requested ([\w.\-]+)"]
    for pattern in patterns:
        for m in re.finditer(pattern, log):
            name = _name(m.group(1))
            for _ in range(10):  # a version another requirement asks for: blame the one that asked
                parent = re.search(rf"^\s*Collecting {_loose(name)}\b.*\(from ([\w.\-]+)", log, re.M | re.I)
                if not parent:
                    break
                name = _name(parent.group(1))
            if name in by_name:
                return by_name[name]
    # a failure while preparing metadata names no package: the last one pip was collecting
    error_at = min((i for i in (log.find("did not run successfully"), log.find("ERROR:")) if i >= 0), default=-1)
    collecting = re.findall(r"^\s*Collecting ([\w.\-]+)", log[:error_at] if error_at >= 0 else log, re.M)
    if collecting and _name(collecting[-1]) in by_name:
        return by_name[_name(collecting[-1])]
    return None


def _loose(name: str) -> str:
    """A regex matching a distribution name however pip spells it (`typed-ast`, `typed_ast`)."""
    return "[-_.]".join(re.escape(part) for part in re.split(r"[-_.]", name))


def relax(requirements: list[str], culprit: str) -> tuple[list[str], str]:
    """The list with `culprit`'s pin dropped (or, unpinned already, the package dropped); a note why."""
    name = _name(culprit)
    if culprit.strip().lower() != name and name != "pytest":
        return [name if r == culprit else r for r in requirements], f"{culprit} -> {name} (does not install here)"
    if name == "pytest" and culprit != "pytest":
        return [("pytest" if r == culprit else r) for r in requirements], f"{culprit} -> pytest"
    return [r for r in requirements if r != culprit], f"{culprit} dropped (does not install here)"


def resolve_env(requirements: list[str], scratch: Path, timeout: float) -> tuple[list[str], list[str]]:
    """Install `requirements` into a scratch venv, relaxing what does not install on this Python;
    (the list that installs, notes)."""
    shutil.rmtree(scratch, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(scratch)
    python = scratch / "bin" / "python"
    notes: list[str] = []
    dropped: list[str] = []
    for _ in range(40):
        ok, log = pip_install(python, requirements, timeout)
        if ok:
            return _readd(python, requirements, dropped, notes, timeout)
        culprit = failing_requirement(log, requirements)
        if culprit is None:
            tail = [ln for ln in log.splitlines() if ln.strip()][-3:]
            raise NotReproducible("the requirements do not install: " + " | ".join(tail)[-400:])
        requirements, note = relax(requirements, culprit)
        notes.append(note)
        if culprit == _name(culprit):
            dropped.append(culprit)
    raise NotReproducible("the requirements do not install (too many pins relaxed)")


def _readd(python: Path, requirements: list[str], dropped: list[str], notes: list[str], timeout: float
           ) -> tuple[list[str], list[str]]:
    """A package dropped because the version another pin asked for did not build (typed-ast under
    mypy 0.770's cap) may install once that pin is relaxed: each gets a second try, kept if the whole
    list still installs with it."""
    for name in dropped:
        trial = sorted([*requirements, name], key=str.lower)
        if pip_install(python, trial, timeout)[0]:
            requirements = trial
            notes.append(f"{name} installs again once the other pins are relaxed")
    return requirements, notes


_PROBE = '''import unittest

import pytest


@pytest.mark.parametrize("x", [1, 2])
def test_value(x):
    assert x == 1


class TestCase(unittest.TestCase):
    def test_ok(self):
        self.assertEqual(len("ab"), 2)
'''
_PROBE_EXPECTED = {"test_probe.py::test_value[1]": "PASSED", "test_probe.py::test_value[2]": "FAILED",
                   "test_probe.py::TestCase::test_ok": "PASSED"}


def probe_pytest(python: Path, args: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Does the environment's pytest run and report a small suite (parametrised, unittest) correctly?
    (verdict, output)"""
    with tempfile.TemporaryDirectory(prefix="openglm-probe-") as tmp:
        (Path(tmp) / "test_probe.py").write_text(_PROBE)
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")
        cmd = pytest_command(["test_probe.py"], args).replace("python -m pytest", f"'{python}' -m pytest", 1)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        _, out, _ = run_command(cmd, Path(tmp), shell=True, timeout=120, env=env)
    return {k: v for k, v in parse_log(out).items() if k in _PROBE_EXPECTED} == _PROBE_EXPECTED, out


def blamed_requirement(output: str, scratch: Path, requirements: list[str]) -> str | None:
    """The requirement whose installed code fails on this Python: the distribution defining the class
    of an object that lacks what this Python asks of it (six 1.15's importer without find_spec), else
    the one whose RECORD lists the file of the deepest site-packages frame in `output` (py 1.8's
    vendored apipkg)."""
    site = Path(_site_packages_of(scratch))
    by_name = {_name(r): r for r in requirements}
    for cls in dict.fromkeys(re.findall(r"'(\w+)' object has no attribute", output)):
        for path in site.rglob("*.py"):
            if re.search(rf"^\s*class {cls}\b", path.read_text(errors="replace"), re.M):
                dist = _owner(site, path.relative_to(site).as_posix())
                if dist in by_name:
                    return by_name[dist]
    frames = re.findall(r'(?:File "|^)(/\S+?/site-packages/[^":\s]+\.py)', output, re.M)
    for path in reversed(frames):
        try:
            rel = Path(path).resolve().relative_to(site.resolve()).as_posix()
        except ValueError:
            continue
        dist = _owner(site, rel)
        if dist in by_name:
            return by_name[dist]
    return None


def _site_packages_of(env: Path) -> str:
    return sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)})


def _owner(site: Path, rel: str) -> str | None:
    """The distribution (normalised name) whose installed-files RECORD lists `rel`."""
    for record in site.glob("*.dist-info/RECORD"):
        if any(line.split(",", 1)[0] == rel for line in record.read_text(errors="replace").splitlines()):
            return _name(record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0])
    return None


def pytest_setup(requirements: list[str], scratch: Path, timeout: float) -> dict:
    """Install the requirements (relaxed where needed) and settle pytest so that it runs and reports
    a probe suite: a dependency whose code raises while pytest starts is unpinned; a failure in pytest
    itself is retried with plain asserts (its rewriting may predate this Python's syntax tree), then
    with the next later pytest release. {"requirements", "pytest_args", "notes"}."""
    reqs, notes = resolve_env(requirements, scratch, timeout)
    python = scratch / "bin" / "python"
    args: list[str] = []
    fallbacks = list(PYTEST_FALLBACKS)
    for _ in range(12):
        ok, output = probe_pytest(python, tuple(args))
        if ok:
            return {"requirements": reqs, "pytest_args": args, "notes": notes}
        culprit = blamed_requirement(output, scratch, reqs)
        if culprit is not None and _name(culprit) != "pytest" and "==" in culprit:
            reqs, note = relax(reqs, culprit)
            notes.append(note.replace("does not install here", "fails to import here"))
        elif not args:
            args = ["--assert=plain"]
            notes.append("pytest runs with --assert=plain (its assertion rewriting fails on this Python)")
            continue
        elif fallbacks:
            pinned = next((r for r in reqs if _name(r) == "pytest"), None)
            if pinned is None:  # the project's requirements name no pytest: bring one
                reqs = [*reqs, fallbacks[0]]
                notes.append(f"no pytest in the requirements runs here: {fallbacks.pop(0)} added")
            else:
                reqs = [fallbacks[0] if r == pinned else r for r in reqs]
                notes.append(f"{pinned} cannot run here: {fallbacks.pop(0)} instead")
            args = []
        else:
            break
        reqs, more = resolve_env(reqs, scratch, timeout)
        notes += more
    raise NotReproducible("no pytest runs in the environment: " + _last_line(output))


class EnvResolver:
    """Resolved environments per raw requirement list, cached in `out_dir/envs.json` (bugs of one
    project mostly share their requirements)."""

    def __init__(self, config: BugsInPyConfig):
        self.config = config
        self.path = config.out_dir / f"envs.v{BUILDER_VERSION}.json"
        self.cache: dict[str, dict] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.no_requirements = {"requirements": [], "pytest_args": [],
                                "notes": ["no requirements: the harness's own packages"]}

    def resolve(self, requirements: list[str]) -> dict:
        if not requirements:
            return self.no_requirements
        key = json.dumps([list(sys.version_info[:2]), requirements])
        if key not in self.cache:
            scratch = Path(tempfile.mkdtemp(prefix="openglm-env-"))
            try:
                self.cache[key] = pytest_setup(requirements, scratch / "venv", self.config.env_timeout)
            except NotReproducible as e:
                self.cache[key] = {"error": str(e)}
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            write_atomic(self.path, json.dumps(self.cache, indent=1))
        entry = self.cache[key]
        if "error" in entry:
            raise NotReproducible(entry["error"])
        return entry

    def set_compat(self, requirements: list[str]) -> None:
        """Instances with these requirements get the removed standard-library names back."""
        if not requirements:
            self.no_requirements["stdlib_compat"] = True
            return
        key = json.dumps([list(sys.version_info[:2]), requirements])
        self.cache[key]["stdlib_compat"] = True
        self.cache[key]["notes"].append("removed standard-library names restored (harness/stdlib_compat.py)")
        write_atomic(self.path, json.dumps(self.cache, indent=1))

    def relax(self, requirements: list[str], culprit: str) -> None:
        """Unpin `culprit` in the environment resolved for `requirements` (its code fails at import)."""
        key = json.dumps([list(sys.version_info[:2]), requirements])
        entry = self.cache[key]
        reqs, note = relax(entry["requirements"], culprit)
        scratch = Path(tempfile.mkdtemp(prefix="openglm-env-"))
        try:
            fresh = pytest_setup(reqs, scratch / "venv", self.config.env_timeout)
            fresh["notes"] = entry["notes"] + [note.replace("does not install here", "fails to import here")] \
                + fresh["notes"]
            self.cache[key] = fresh
        except NotReproducible as e:
            self.cache[key] = {"error": str(e)}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        write_atomic(self.path, json.dumps(self.cache, indent=1))


# ---- one instance -------------------------------------------------------------------------------------------
def draft_instance(bug: Bug, repo: Path, env: dict) -> dict:
    """The SWE-bench record before grading (FAIL_TO_PASS = the named tests)."""
    files = set(git(repo, "ls-tree", "-r", "--name-only", bug.fixed).splitlines())
    tests = node_ids(bug.commands, files)
    if not tests:
        raise NotReproducible("run_test.sh names no test")
    gold, test_patch = fix_patches(repo, bug)
    statement = (f"{bug.project}: the tests {', '.join(tests)} fail at commit {bug.buggy[:12]} "
                 f"(BugsInPy {bug.project} bug {bug.number}).")
    return {
        "instance_id": bug.instance_id, "repo": bug.repo, "base_commit": bug.buggy,
        "environment_setup_commit": bug.buggy, "version": "bugsinpy", "created_at": "",
        "problem_statement": statement, "hints_text": "", "patch": gold, "test_patch": test_patch,
        "FAIL_TO_PASS": tests, "PASS_TO_PASS": [],
        # openglm extensions: the dependency environment, the fixed commit, where the fix is
        "openglm_env": {"requirements": env["requirements"], "pytest_args": env["pytest_args"],
                        **({"install_cmd": INSTALL_CMD} if bug.install else {}),
                        **({"stdlib_compat": True} if env.get("stdlib_compat") else {})},
        "openglm_bugsinpy": {"project": bug.project, "bug": bug.number, "fixed_commit": bug.fixed,
                             "env_notes": env["notes"]},
        "openglm_bug": buggy_locations(repo, bug.buggy, gold),
    }


def graded(instance: dict, harness: HarnessConfig, patch: str) -> tuple[dict[str, str], str]:
    """The harness's verdict on the instance with `patch` applied: ({test: status}, test output)."""
    with Sandbox(instance, harness) as box:
        if not box.apply(patch):
            raise NotReproducible("the gold patch does not apply")
        status, output = box.run_tests()
        return status, output


def check_reproduction(instance: dict, harness: HarnessConfig) -> dict:
    """Grade the gold and the empty patch; the instance with FAIL_TO_PASS / PASS_TO_PASS, or
    NotReproducible naming the first test that does not behave. A named test that is parametrised
    stands for its cases: all must pass with the fix, one at least fail without it; FAIL_TO_PASS
    are the cases that do."""
    after, out_after = graded(instance, harness, instance["patch"])
    if not after:
        raise NotReproducible("no per-test result with the fix: " + _last_line(out_after), out_after)
    cases = {}
    for test in instance["FAIL_TO_PASS"]:
        cases[test] = [t for t in after if t == test or t.startswith(test + "[")]
        if not cases[test]:
            raise NotReproducible(f"{test} is not collected: " + _failure_line(out_after, test), out_after)
        for case in cases[test]:
            if not test_passed(case, after):
                raise NotReproducible(f"{case} fails with the fix ({after[case]}): " + _failure_line(out_after, case),
                                      out_after)
    before, _ = graded(instance, harness, "")
    f2p = []
    for test, names in cases.items():
        failing = [t for t in names if not test_passed(t, before)]
        if not failing:
            raise NotReproducible(f"{test} passes without the fix")
        f2p += failing
    p2p = sorted(t for t in after if test_passed(t, after) and test_passed(t, before))
    return dict(instance, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p)


def _last_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _failure_line(output: str, test: str) -> str:
    """The `E   ...` line closest after the test's failure header, for the skip reason."""
    name = test.split("::")[-1]
    at = output.find(f" {name} ")
    errors = re.findall(r"^E\s+(.*)$", output[at:] if at >= 0 else output, re.M)
    return (errors[0] if errors else _last_line(output))[:300]


def build_bug(bug: Bug, config: BugsInPyConfig, resolver: EnvResolver) -> dict:
    """{"instance": ...} or {"skipped": reason}, with the seconds it took."""
    t0 = time.time()
    try:
        repo = source_repo({"repo": bug.repo}, config.repos_dir)
        for sha in (bug.buggy, bug.fixed):
            if git(repo, "cat-file", "-t", sha, check=False).strip() != "commit":
                raise NotReproducible(f"commit {sha} is not in {repo} (fetch the project's full history)")
        harness = HarnessConfig(repos_dir=config.repos_dir, envs_dir=config.envs_dir, timeout=config.timeout,
                                env_timeout=config.env_timeout)
        raw = clean_requirements(bug)
        for _ in range(MAX_IMPORT_RELAXES):
            env = resolver.resolve(raw)
            deps = dependency_env(env["requirements"], config.envs_dir, config.env_timeout) \
                if env["requirements"] else None
            try:
                instance = check_reproduction(draft_instance(bug, repo, env), harness)
                return {"instance": instance, "seconds": round(time.time() - t0, 1)}
            except NotReproducible as e:
                if REMOVED_STDLIB.search(e.output) and not env.get("stdlib_compat"):
                    resolver.set_compat(raw)  # the project imports what this Python removed: restore it
                    continue
                if deps is None:
                    raise
                # a pinned dependency whose code raises on this Python (aiohttp 3.6 under 3.11): unpin it
                culprit = blamed_requirement(e.output, deps, env["requirements"])
                if culprit is None or "==" not in culprit or _name(culprit) == "pytest":
                    raise
                resolver.relax(raw, culprit)
        raise NotReproducible("the dependencies still fail to import after relaxing pins")
    except (NotReproducible, EnvBuildError, GitError) as e:
        return {"skipped": str(e), "seconds": round(time.time() - t0, 1)}


def build(config: BugsInPyConfig) -> Path:
    """Build every selected bug (cached per bug); writes instances.jsonl and skipped.jsonl."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    resolver = EnvResolver(config)
    instances, skipped = [], []
    bugs = list_bugs(config)
    for bug in tqdm(bugs, desc="bugsinpy", unit="bug"):
        cache = config.out_dir / "bugs" / f"{bug.instance_id}.v{BUILDER_VERSION}.json"
        if cache.exists():
            outcome = json.loads(cache.read_text())
        else:
            outcome = build_bug(bug, config, resolver)
            write_atomic(cache, json.dumps(outcome, indent=1))
        if "instance" in outcome:
            instances.append(outcome["instance"])
        else:
            skipped.append({"instance_id": bug.instance_id, "reason": outcome["skipped"]})
            tqdm.write(f"{bug.instance_id}: skipped: {outcome['skipped']}", file=sys.stderr)
    write_atomic(config.out_dir / "instances.jsonl", "".join(json.dumps(i) + "\n" for i in instances))
    write_atomic(config.out_dir / "skipped.jsonl", "".join(json.dumps(s) + "\n" for s in skipped))
    print(f"{len(instances)} of {len(bugs)} bugs reproduce -> {config.out_dir / 'instances.jsonl'}"
          f" (skipped, with the reason: {config.out_dir / 'skipped.jsonl'})", file=sys.stderr)
    return config.out_dir / "instances.jsonl"
