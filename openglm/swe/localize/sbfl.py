"""Spectrum-based fault localisation: lines executed by failing tests and few passing tests are
suspicious. Score per line is Ochiai: ef / sqrt(total_failed * (ef + ep)). A function scores the
best of its lines, a file the best of its functions' lines. Lines outside any function (module-level
statements, class bodies) belong to the candidate `path::<module>`.

Tests neither failing nor passing (skipped, or failing for reasons the caller set aside) count for
nothing; failure-reporting code never reaches the spectrum (the plugin records it apart).
"""

from __future__ import annotations

import math
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex, is_test_path
from openglm.swe.testrun import per_test_lines

MODULE = "<module>"  # the candidate of a line outside any function


def ochiai(ef: int, ep: int, total_failed: int) -> float:
    if ef == 0 or total_failed == 0:
        return 0.0
    return ef / math.sqrt(total_failed * (ef + ep))


def function_key(index: FunctionIndex, rel: str, line: int) -> str:
    """The candidate a line belongs to: its innermost function, else the module."""
    fn = index.function_at(rel, line)
    return fn.key if fn is not None else f"{rel}::{MODULE}"


def spectrum(index: FunctionIndex, coverage_file: str, failed: set[str], passed: set[str]
             ) -> dict[str, dict[int, list[int]]]:
    """{file: {line: [ef, ep]}} over the repository's non-test files."""
    out: dict[str, dict[int, list[int]]] = {}
    for path, by_test in per_test_lines(coverage_file).items():
        rel = index.rel(Path(path))
        if rel is None or is_test_path(rel):
            continue
        counts = out.setdefault(rel, {})
        for test, lines in by_test.items():
            slot = 0 if test in failed else 1 if test in passed else None
            if slot is None:
                continue
            for line in lines:
                counts.setdefault(line, [0, 0])[slot] += 1
    return out


def sbfl_scores(index: FunctionIndex, counts: dict[str, dict[int, list[int]]], n_failed: int
                ) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    for rel, lines in counts.items():
        for line, (ef, ep) in lines.items():
            s = ochiai(ef, ep, n_failed)
            if s <= 0:
                continue
            scores["lines"][f"{rel}:{line}"] = s
            scores["files"][rel] = max(scores["files"].get(rel, 0.0), s)
            key = function_key(index, rel, line)
            scores["functions"][key] = max(scores["functions"].get(key, 0.0), s)
    return scores
