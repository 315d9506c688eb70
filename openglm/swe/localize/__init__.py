"""Model-free fault localisation: rank files, functions and lines for failing tests.

Techniques, each giving scores at the three levels, then a weighted combination:
- sbfl: Ochiai over per-test coverage of the failing tests vs the passing ones (coverage.py, one
  context per test), with the module-level data the suspicious lines read (`globals.py`);
- traceback: frames of the failure output and of the issue statement (deepest first), and the
  modules a failing test could not import a name from;
- text: BM25 between the issue statement and each function's identifiers;
- tests: BM25 between the failing tests' own code (names, bodies) and the functions they ran;
- retrieval (optional): openglm.retrieval's code index, when the repo has one.

The failing set is the named tests (`--failing`); other tests that fail in the same run are listed
apart (`other_failing`) and count neither way. Without named tests the whole suite runs and the
failing set is chosen from what fails (`failing_set`, see `choose_failing`). Candidates are functions
(nested ones included) and `path::<module>` for statements outside any function. Lines of equal score
are ordered by what distinguishes them (`ties.py`), not by line number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from openglm import retrieval
from openglm.retrieval.spans import FunctionIndex
from openglm.swe.localize.globals import global_scores
from openglm.swe.localize.sbfl import MODULE, function_key, sbfl_scores, spectrum
from openglm.swe.localize.suite import choose_failing, named_matches
from openglm.swe.localize.text import test_text_scores, text_scores
from openglm.swe.localize.ties import tie_breaks
from openglm.swe.localize.traceback import import_scores, missing_names, traceback_scores
from openglm.swe.testrun import TestRun, run_pytest, source_paths

LEVELS = ("files", "functions", "lines")


@dataclass
class LocalizeConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"sbfl": 1.0, "traceback": 0.7, "imports": 1.0,
                                                                 "text": 0.3, "tests": 0.3, "retrieval": 0.2})
    scope: str = "files"  # "files": the failing tests' files; "all": the whole suite
    top: int = 20
    timeout: float = 600  # seconds the test run may take (no test starts after it)
    test_timeout: float = 120  # seconds one test may take
    pythonpath: list[str] | None = None  # sys.path entries relative to the repo; default src/ or root
    python: str | None = None  # the interpreter (and its pytest) the tests run under; default openglm's
    pytest_args: list[str] = field(default_factory=list)
    find_failing: bool = False  # no failing tests given: run the whole suite and localise what fails


def _normalised(scores: dict[str, float]) -> dict[str, float]:
    top = max(scores.values(), default=0.0)
    return {k: v / top for k, v in scores.items()} if top > 0 else {}


def combine(techniques: dict[str, dict[str, dict[str, float]]], weights: dict[str, float],
            index: FunctionIndex) -> dict[str, dict[str, float]]:
    """Weighted sum of per-technique scores normalised to [0, 1]; a line also inherits half of its
    function's combined score, so lines of a suspicious function outrank equally-scored strays."""
    out: dict[str, dict[str, float]] = {level: {} for level in LEVELS}
    for name, levels in techniques.items():
        w = weights.get(name, 0.0)
        for level in LEVELS:
            for key, s in _normalised(levels.get(level, {})).items():
                out[level][key] = out[level].get(key, 0.0) + w * s
    fn_norm = _normalised(out["functions"])
    for key in list(out["lines"]):
        rel, line = key.rsplit(":", 1)
        out["lines"][key] += 0.5 * fn_norm.get(function_key(index, rel, int(line)), 0.0)
    return out


def ranked(scores: dict[str, float], top: int, tie: dict[str, float] | None = None) -> list[dict]:
    """Best first; equal scores by `tie` (higher first), then by path and line number."""
    tie = tie or {}

    def order(kv):
        path, _, line = kv[0].rpartition(":")
        return (-round(kv[1], 9), -tie.get(kv[0], 0.0), path or kv[0], int(line) if line.isdigit() else 0)

    items = sorted(scores.items(), key=order)[:top]
    return [{"location": k, "score": round(v, 4)} for k, v in items]


def _merge_max(into: dict[str, dict[str, float]], extra: dict[str, dict[str, float]]) -> None:
    for level, scores in extra.items():
        for key, s in scores.items():
            into[level][key] = max(into[level].get(key, 0.0), s)


def run_for(repo: Path, failing_tests: list[str], config: LocalizeConfig) -> TestRun:
    """The one test run: the failing tests' files (scope "files"), else the whole suite."""
    files = config.scope == "files" and failing_tests
    targets = sorted({t.split("::")[0] for t in failing_tests}) if files else []
    return run_pytest(repo, targets, python=config.python, pythonpath=config.pythonpath,
                      timeout=config.timeout, test_timeout=config.test_timeout, extra_args=config.pytest_args,
                      coverage_source=source_paths(repo, config.pythonpath))


def localize(repo: str | Path, failing_tests: list[str] = (), issue: str = "", test_output: str = "",
             config: LocalizeConfig | None = None) -> dict:
    """Rank suspicious locations. failing_tests are pytest node ids (`tests/test_x.py::test_y`)."""
    config = config or LocalizeConfig()
    repo = Path(repo).resolve()
    index = FunctionIndex(repo)
    techniques: dict[str, dict[str, dict[str, float]]] = {}
    texts = [issue, test_output]
    report: dict = {"failing_set": [], "other_failing": [], "collection_errors": {}, "tests_ran": 0,
                    "timed_out": False, "notes": []}
    if failing_tests or config.find_failing:
        with run_for(repo, list(failing_tests), config) as run:
            if failing_tests:
                failing, other, notes = named_matches(run, list(failing_tests))
            else:
                failing, other, notes = choose_failing(run, repo)
            report.update(failing_set=failing, other_failing=other, notes=notes, timed_out=run.timed_out,
                          tests_ran=sum(1 for r in run.results.values() if r["outcome"] != "collect_error"),
                          collection_errors={n: r["longrepr"][-1500:] for n, r in run.results.items()
                                             if r["outcome"] == "collect_error"})
            if not run.results and run.output:
                report["output_tail"] = run.output[-2000:]
            failure_texts = [run.results[t]["longrepr"] for t in failing if t in run.results]
            # a test that failed on a name its module lacks stopped before the code under test ran:
            # its coverage is set-up only, the missing name is the evidence (`imports`)
            spectral = [t for t in failing if t in run.results and not missing_names(index, run.results[t]["longrepr"])]
            passed = set(run.passed)
            if run.coverage_file and spectral:
                counts = spectrum(index, run.coverage_file, set(spectral), passed)
                sbfl = sbfl_scores(index, counts, len(spectral))
                _merge_max(sbfl, global_scores(index, sbfl["lines"], MODULE))
                techniques["sbfl"] = sbfl
                techniques["tests"] = test_text_scores(index, spectral, counts, failure_texts)
        texts += failure_texts
        imports = import_scores(index, failure_texts, MODULE)
        if imports["files"]:
            techniques["imports"] = imports
    techniques["traceback"] = traceback_scores(index, [t for t in texts if t])
    if issue:
        techniques["text"] = text_scores(index, issue)
        retrieved = _retrieval_scores(repo, issue)
        if retrieved:
            techniques["retrieval"] = retrieved
    combined = combine(techniques, config.weights, index)
    tie = tie_breaks(repo, index, combined["lines"], config.top)
    return {
        "repo": str(repo),
        "failing_tests": list(failing_tests),
        "observed_failing": report["failing_set"],
        **report,
        "combined": {level: ranked(combined[level], config.top, tie if level == "lines" else None)
                     for level in LEVELS},
        "techniques": {name: {level: ranked(s.get(level, {}), config.top) for level in LEVELS}
                       for name, s in techniques.items()},
    }


def _retrieval_scores(repo: Path, issue: str) -> dict[str, dict[str, float]] | None:
    """Optional signal from the code retrieval index (openglm.retrieval), used only when the repo
    already has an index (`openglm index build REPO`): building one here would embed the repo."""
    try:
        hits = retrieval.CodeIndex.open(repo).search(issue, k=20)  # a lazy export: FAISS loads here
    except Exception:  # no index, no embedder model, retrieval not built yet: not an error here
        return None
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    for h in hits:
        s = float(h.score)
        scores["files"][h.path] = max(scores["files"].get(h.path, 0.0), s)
        if h.kind in ("function", "method"):
            scores["functions"][h.key] = max(scores["functions"].get(h.key, 0.0), s)
    return scores
