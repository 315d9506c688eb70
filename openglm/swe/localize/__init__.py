"""Model-free fault localisation: rank files, functions and lines for a failing test.

Three techniques, each giving scores at the three levels, then a weighted combination:
- traceback: frames of the failure output and of the issue statement (deepest first);
- sbfl: Ochiai over per-test coverage of failing vs passing tests (coverage.py, contexts per test);
- text: BM25 between the issue statement and each function's identifiers.
An optional fourth signal, `retrieval`, comes from openglm.retrieval's code index when the repo has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from openglm import retrieval
from openglm.retrieval.spans import FunctionIndex
from openglm.swe.localize.sbfl import sbfl_scores
from openglm.swe.localize.text import text_scores
from openglm.swe.localize.traceback import traceback_scores
from openglm.swe.testrun import run_pytest, source_paths

LEVELS = ("files", "functions", "lines")


@dataclass
class LocalizeConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"sbfl": 1.0, "traceback": 0.7,
                                                                 "text": 0.3, "retrieval": 0.2})
    scope: str = "files"  # "files": the failing tests' files; "all": the whole suite
    top: int = 20
    timeout: float = 600
    pythonpath: list[str] | None = None  # sys.path entries relative to the repo; default src/ or root


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
        fn = index.function_at(rel, int(line))
        if fn is not None:
            out["lines"][key] += 0.5 * fn_norm.get(fn.key, 0.0)
    return out


def _tie_key(key: str) -> tuple:
    """Equal scores: by path, then numerically by line (`a.py:9` before `a.py:10`)."""
    path, _, line = key.rpartition(":")
    return (path, int(line)) if line.isdigit() else (key, 0)


def ranked(scores: dict[str, float], top: int) -> list[dict]:
    items = sorted(scores.items(), key=lambda kv: (-kv[1], _tie_key(kv[0])))[:top]
    return [{"location": k, "score": round(v, 4)} for k, v in items]


def localize(repo: str | Path, failing_tests: list[str] = (), issue: str = "", test_output: str = "",
             config: LocalizeConfig | None = None) -> dict:
    """Rank suspicious locations. failing_tests are pytest node ids (`tests/test_x.py::test_y`)."""
    config = config or LocalizeConfig()
    repo = Path(repo).resolve()
    index = FunctionIndex(repo)
    techniques: dict[str, dict[str, dict[str, float]]] = {}
    texts = [issue, test_output]
    observed_failing: list[str] = []
    if failing_tests:
        targets = sorted({t.split("::")[0] for t in failing_tests}) if config.scope == "files" else []
        run = run_pytest(repo, targets, pythonpath=config.pythonpath, timeout=config.timeout,
                         coverage_source=source_paths(repo, config.pythonpath))
        failed, passed = set(run.failed), set(run.passed)
        observed_failing = sorted(failed)
        if run.coverage_file:
            techniques["sbfl"] = sbfl_scores(index, run.coverage_file, failed, passed)
        texts += [run.results[t]["longrepr"] for t in sorted(failed)]
    techniques["traceback"] = traceback_scores(index, [t for t in texts if t])
    if issue:
        techniques["text"] = text_scores(index, issue)
        retrieved = _retrieval_scores(repo, issue)
        if retrieved:
            techniques["retrieval"] = retrieved
    combined = combine(techniques, config.weights, index)
    return {
        "repo": str(repo),
        "failing_tests": list(failing_tests),
        "observed_failing": observed_failing,
        "combined": {level: ranked(combined[level], config.top) for level in LEVELS},
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
