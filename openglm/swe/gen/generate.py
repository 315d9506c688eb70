"""Generate SWE-bench-format instances by injecting one bug into a real PyPI package.

Per package: download the pinned sdist (pip, PyPI), make it a git repo, run its suite once with
per-test coverage, then try AST mutations of covered functions. A mutant is screened by running
the tests that execute the mutated line (at least one must fail, the others pass); a survivor is
stored as a commit (the instance's base_commit) and then validated exactly as the harness grades
it: in a harness sandbox (private checkout + venv), the harness's test command over the whole
test files, twice on the buggy tree and twice on the clean one. It is kept only if both runs of
each side agree (not flaky) and the tests that fail on the buggy tree and pass on the clean one
are exactly the screened failures (no order-dependent or file-level surprises); those become
FAIL_TO_PASS, the tests passing on both sides PASS_TO_PASS, and the inverse diff the gold patch.
Everything lives under the cache folder (default .bench/swe-gen); reruns reuse it.
"""

from __future__ import annotations

import ast
import json
import random
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from openglm.retrieval.spans import FunctionIndex, functions_with_qualnames, is_test_path
from openglm.swe.gen.mutate import Mutation, mutations_of
from openglm.swe.gen.packages import PackageSpec
from openglm.swe.harness.run import HarnessConfig, Sandbox, pytest_command, test_files
from openglm.swe.logparse import test_passed
from openglm.swe.testrun import per_test_lines, run_pytest
from openglm.util import proc
from openglm.util.files import write_atomic
from openglm.util.git import commit_file_change, git, init_repo, unified_diff

# Bump when the selection rules change, so cached per-package instance files are not reused.
GENERATOR_VERSION = 2


@dataclass
class GenConfig:
    out_dir: Path = Path(".bench/swe-gen")
    per_package: int = 25
    seed: int = 0
    max_tries_per_function: int = 3
    max_failing: int = 50  # mutants breaking more tests than this are too blunt to be interesting
    screen_timeout: float = 20  # seconds for the screening run of the covering tests
    grade_runs: int = 2  # harness-style runs per side; runs that disagree mark the mutant flaky
    grade_timeout: float = 300  # seconds for one harness-style run of the test files


def fetch_package(spec: PackageSpec, out_dir: Path) -> tuple[Path, str]:
    """Download + unpack the sdist into a git repo (once); returns (repo path, pristine commit)."""
    out_dir = out_dir.resolve()  # git runs inside the repo: relative paths would not resolve there
    repo = out_dir / "repos" / f"pypi__{spec.slug}"
    if (repo / ".git").exists():
        # an interrupted run may have left a mutant in the work tree: back to the pristine sdist
        git(repo, "reset", "-q", "--hard")
        git(repo, "clean", "-q", "-fdx")
        return repo, git(repo, "rev-list", "--max-parents=0", "HEAD").strip()
    sdists = out_dir / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    archive = next(sdists.glob(f"{spec.name.replace('-', '?')}-{spec.version}.tar.gz"), None)
    if archive is None:
        got = proc.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                        ":all:", "-d", str(sdists), f"{spec.name}=={spec.version}"], merge_stderr=True)
        if not got.ok:
            raise RuntimeError(f"pip download {spec.name}=={spec.version} failed: {got.stdout.strip()[-500:]}")
        archive = next(sdists.glob(f"{spec.name.replace('-', '?')}-{spec.version}.tar.gz"))
    tmp = repo.with_suffix(".tmp")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    (top,) = list(tmp.iterdir())
    sha = init_repo(top, f"{spec.slug} from its PyPI sdist")
    top.rename(repo)
    tmp.rmdir()
    return repo, sha


def _problem_statement(spec: PackageSpec, failed: list[str], results: dict) -> str:
    first = failed[0]
    trace = results[first]["longrepr"].strip().splitlines()
    if len(trace) > 40:
        trace = ["..."] + trace[-40:]
    more = f" ({len(failed) - 1} other test(s) fail too)" if len(failed) > 1 else ""
    body = "\n".join(trace)
    return (f"{spec.name} {spec.version}: `{first}` fails{more}.\n\n"
            f"Running the test suite gives:\n\n```\n{body}\n```\n")


def coverage_roots(spec: PackageSpec, repo: Path) -> list[str]:
    """coverage.py measures directories (or importable names), not files: a single-module package
    (`parse.py`) is measured through the folder holding it; candidates() narrows back to spec.source."""
    return sorted({s if (repo / s).is_dir() else str(Path(s).parent) for s in spec.source})


class PackageMiner:
    def __init__(self, spec: PackageSpec, config: GenConfig):
        self.spec, self.config = spec, config
        self.repo, self.pristine = fetch_package(spec, config.out_dir)
        self.harness = HarnessConfig(repos_dir=config.out_dir / "repos", timeout=config.grade_timeout)
        self._clean: dict[tuple[str, ...], dict[str, str] | None] = {}  # test files -> graded status
        self.rejected: dict[str, int] = {}  # why screened mutants were rejected, for the log
        with run_pytest(self.repo, list(spec.tests), coverage_source=coverage_roots(spec, self.repo)) as base:
            self.passing = set(base.passed)
            if not self.passing:
                raise RuntimeError(f"{spec.slug}: no test passes on the pristine sdist:\n{base.output[-2000:]}")
            covered = per_test_lines(base.coverage_file)
        # (file, line) -> passing tests that execute it
        self.line_tests: dict[tuple[str, int], set[str]] = {}
        index = FunctionIndex(self.repo)
        for path, by_test in covered.items():
            rel = index.rel(path)
            for test, lines in by_test.items():
                if test in self.passing:
                    for line in lines:
                        self.line_tests.setdefault((rel, line), set()).add(test)
        if not self.line_tests:
            raise RuntimeError(f"{spec.slug}: coverage recorded no line of {spec.source}")

    def covering_tests(self, rel: str, line: int) -> set[str]:
        return self.line_tests.get((rel, line), set())

    def candidates(self) -> list[tuple[str, str, list[Mutation]]]:
        """(file, function qualname, its mutations on covered lines) for every covered function."""
        out = []
        index = FunctionIndex(self.repo)
        for rel, source in sorted(index.sources.items()):
            if is_test_path(rel) or not any(rel == s or rel.startswith(s + "/") for s in self.spec.source):
                continue
            for qual, node in functions_with_qualnames(ast.parse(source)):
                muts = [m for m in mutations_of(source, node)
                        if self.covering_tests(rel, m.line)]
                if muts:
                    out.append((rel, qual, muts))
        return out

    def screen(self, rel: str, mutation: Mutation) -> dict | None:
        """Apply, run the tests that execute the mutated line, restore; the verdict or None.
        Tests that never reach the line behave exactly as before, so they need not run. This is
        only a cheap filter: grade() decides with the harness's own runner."""
        path = self.repo / rel
        clean = path.read_text()
        buggy = mutation.apply(clean)
        try:
            compile(buggy, rel, "exec")
        except SyntaxError:
            return None
        expected = self.covering_tests(rel, mutation.line)
        path.write_text(buggy)
        try:
            run = run_pytest(self.repo, sorted(expected), timeout=self.config.screen_timeout)
        finally:
            path.write_text(clean)
        failed = [t for t in run.failed if t in expected]
        passed = [t for t in run.passed if t in expected]
        if run.timed_out or not failed or len(failed) > self.config.max_failing:
            return None
        if len(failed) + len(passed) != len(expected):
            return None  # a test vanished (collection broke) or was skipped: not a clean mutant
        return {"buggy": buggy, "clean": clean, "failed": failed, "passed": passed, "results": run.results}

    def graded_status(self, instance: dict) -> dict[str, str] | None:
        """The harness's verdict on `instance` as it stands (no patch): {test: status} when
        grade_runs runs in one sandbox agree, None when they differ or a run cannot be parsed."""
        try:
            with Sandbox(instance, self.harness) as box:
                runs = []
                for _ in range(self.config.grade_runs):
                    box.reset()
                    runs.append(box.run_tests()[0])
        except Exception:  # a test patch or environment that fails: the harness would not grade it either
            return None
        return runs[0] if runs[0] and all(r == runs[0] for r in runs) else None  # empty: a crashed run

    def clean_status(self, files: tuple[str, ...]) -> dict[str, str] | None:
        """graded_status of the pristine tree (what the gold patch restores) for these test files;
        it does not depend on the mutant, so it is computed once per set of files."""
        if files not in self._clean:
            probe = {"instance_id": f"{self.spec.slug}-pristine", "repo": f"pypi/{self.spec.slug}",
                     "base_commit": self.pristine, "test_patch": "", "FAIL_TO_PASS": [],
                     "PASS_TO_PASS": [], "test_cmd": pytest_command(files)}
            self._clean[files] = self.graded_status(probe)
        return self._clean[files]

    def grade(self, candidate: dict, screened_failed: list[str]) -> tuple[list[str], list[str]] | None:
        """(FAIL_TO_PASS, PASS_TO_PASS) as the harness sees them, or None (with the reason counted)
        when the mutant is flaky or its harness-graded failures are not the screened ones."""
        files = tuple(test_files(candidate))
        buggy = self.graded_status(candidate)
        clean = self.clean_status(files)
        if buggy is None or clean is None:
            return self._reject("flaky or ungradable")
        f2p = sorted(t for t in clean if test_passed(t, clean) and not test_passed(t, buggy))
        if f2p != sorted(screened_failed):
            return self._reject("FAIL_TO_PASS differs when graded")
        p2p = sorted(t for t in clean if test_passed(t, clean) and test_passed(t, buggy))
        return f2p, p2p

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return None

    def try_mutation(self, rel: str, qual: str, m: Mutation, number: int) -> dict | None:
        """Screen, commit and grade one mutant; the instance or None."""
        verdict = self.screen(rel, m)
        if verdict is None:
            return None
        inst = self.instance(rel, qual, m, verdict, number)
        graded = self.grade(inst, verdict["failed"])
        if graded is None:
            git(self.repo, "update-ref", "-d", f"refs/openglm/{inst['instance_id']}")
            return None
        inst["FAIL_TO_PASS"], inst["PASS_TO_PASS"] = graded
        return inst

    def mine(self, start_id: int = 0) -> list[dict]:
        rng = random.Random(f"{self.config.seed}-{self.spec.slug}")
        pool = self.candidates()
        rng.shuffle(pool)
        instances: list[dict] = []
        bar = tqdm(total=self.config.per_package, desc=self.spec.slug, unit="inst", leave=False)
        for rel, qual, muts in pool:
            if len(instances) >= self.config.per_package:
                break
            by_kind: dict[str, list[Mutation]] = {}
            for m in muts:
                by_kind.setdefault(m.kind, []).append(m)
            for _ in range(self.config.max_tries_per_function):
                kind = rng.choice(sorted(by_kind))  # kinds first, so off-by-ones do not dominate
                m = rng.choice(by_kind[kind])
                inst = self.try_mutation(rel, qual, m, start_id + len(instances))
                if inst:
                    instances.append(inst)
                    bar.update(1)
                    break
        bar.close()
        return instances

    def instance(self, rel: str, qual: str, m: Mutation, v: dict, number: int) -> dict:
        iid = f"{self.spec.name}-{number:04d}"
        base = commit_file_change(self.repo, self.pristine, rel, v["buggy"], f"inject {m.kind} in {qual}",
                                  f"refs/openglm/{iid}")
        lines = [m.line] if m.kind != "drop_statement" else [max(m.line - 1, 1), m.line]
        return {
            "instance_id": iid,
            "repo": f"pypi/{self.spec.slug}",
            "base_commit": base,
            "environment_setup_commit": base,
            "version": self.spec.version,
            "created_at": "2025-01-01T00:00:00Z",
            "problem_statement": _problem_statement(self.spec, v["failed"], v["results"]),
            "hints_text": "",
            "patch": unified_diff(rel, v["buggy"], v["clean"]),
            "test_patch": "",
            "FAIL_TO_PASS": v["failed"],
            "PASS_TO_PASS": v["passed"],
            # openglm extension: where the bug is, for the localisation benchmark
            "openglm_bug": {"file": rel, "function": qual, "lines": lines, "kind": m.kind,
                            "description": m.description},
        }


def generate(specs: list[PackageSpec], config: GenConfig) -> Path:
    """Mine every package (cached per package) and write instances.jsonl + queries.jsonl."""
    out = config.out_dir
    (out / "instances").mkdir(parents=True, exist_ok=True)
    everything = []
    for spec in specs:
        cache = out / "instances" / f"{spec.slug}.v{GENERATOR_VERSION}.seed{config.seed}.n{config.per_package}.json"
        note = "cached"
        if cache.exists():
            mined = json.loads(cache.read_text())
        else:
            miner = PackageMiner(spec, config)
            mined = miner.mine()
            write_atomic(cache, json.dumps(mined, indent=1))
            note = f"screened mutants rejected when graded: {miner.rejected or 'none'}"
        print(f"{spec.slug}: {len(mined)} instances ({note})", file=sys.stderr)
        everything += mined
    write_atomic(out / "instances.jsonl", "".join(json.dumps(i) + "\n" for i in everything))
    return out / "instances.jsonl"


def export_queries(instances: list[dict], path: Path) -> None:
    """Problem statements with the buggy file/function, for the retrieval engineer's evaluation."""
    rows = [{"instance_id": i["instance_id"], "repo": i["repo"], "base_commit": i["base_commit"],
             "query": i["problem_statement"], "file": i["openglm_bug"]["file"],
             "function": i["openglm_bug"]["function"], "lines": i["openglm_bug"]["lines"]}
            for i in instances if "openglm_bug" in i]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))

