"""Spectrum-based fault localisation: lines executed by failing tests and few passing tests are
suspicious. Score per line is Ochiai: ef / sqrt(total_failed * (ef + ep)). A function scores the
best of its lines, a file the best of its functions' lines."""

from __future__ import annotations

import math
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex, is_test_path
from openglm.swe.testrun import per_test_lines


def ochiai(ef: int, ep: int, total_failed: int) -> float:
    if ef == 0 or total_failed == 0:
        return 0.0
    return ef / math.sqrt(total_failed * (ef + ep))


def sbfl_scores(index: FunctionIndex, coverage_file: str, failed: set[str], passed: set[str]
                ) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    if not failed:
        return scores
    for path, by_test in per_test_lines(coverage_file).items():
        rel = index.rel(Path(path))
        if rel is None or is_test_path(rel):
            continue
        counts: dict[int, list[int]] = {}  # line -> [ef, ep]
        for test, lines in by_test.items():
            slot = 0 if test in failed else 1 if test in passed else None
            if slot is None:
                continue
            for line in lines:
                counts.setdefault(line, [0, 0])[slot] += 1
        for line, (ef, ep) in counts.items():
            s = ochiai(ef, ep, len(failed))
            if s <= 0:
                continue
            scores["lines"][f"{rel}:{line}"] = s
            scores["files"][rel] = max(scores["files"].get(rel, 0.0), s)
            fn = index.function_at(rel, line)
            if fn is not None:
                scores["functions"][fn.key] = max(scores["functions"].get(fn.key, 0.0), s)
    return scores
