"""Spectrum-based fault localisation: lines executed by failing tests and few passing tests are
suspicious. Score per line is Ochiai: ef / sqrt(total_failed * (ef + ep)). A function scores the
best of its lines, a file the best of its functions' lines. Lines outside any function (module-level
statements, class bodies) belong to the candidate `path::<module>`.

Tests neither failing nor passing (skipped, or failing for reasons the caller set aside) count for
nothing; failure-reporting code never reaches the spectrum (the plugin records it apart). Executions
are counted per test and per assertion segment (the plugin starts one at each passing assertion): in
a test that checks `f` twenty times and fails on the twenty-first, the first twenty calls are passing
executions at segment level, so what the failing call ran alone scores highest among the lines the
failing test runs.
"""

from __future__ import annotations

import math
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex, is_test_path
from openglm.swe.testrun import per_segment_lines

MODULE = "<module>"  # the candidate of a line outside any function
SEGMENT_WEIGHT = 0.5


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
    """{file: {line: [ef, ep, segment ef, segment ep]}} over the repository's non-test files: per
    test, and per assertion segment (a passing test's segments all pass; a failing test's last
    segment fails and those before it, each ended by a passing assertion, pass)."""
    segments = per_segment_lines(coverage_file)
    last: dict[str, int] = {}
    for by_unit in segments.values():
        for test, seg in by_unit:
            last[test] = max(last.get(test, 0), seg)
    out: dict[str, dict[int, list[int]]] = {}
    for path, by_unit in segments.items():
        rel = index.rel(Path(path))
        if rel is None or is_test_path(rel):
            continue
        counts = out.setdefault(rel, {})
        by_test: dict[str, set[int]] = {}
        for (test, seg), lines in by_unit.items():
            if test not in failed and test not in passed:
                continue
            by_test.setdefault(test, set()).update(lines)
            slot = 2 if test in failed and seg == last[test] else 3
            for line in lines:
                counts.setdefault(line, [0, 0, 0, 0])[slot] += 1
        for test, lines in by_test.items():
            for line in lines:
                counts[line][0 if test in failed else 1] += 1
    return out


def sbfl_scores(index: FunctionIndex, counts: dict[str, dict[int, list[int]]], n_failed: int
                ) -> dict[str, dict[str, float]]:
    """Ochiai per test, plus SEGMENT_WEIGHT x Ochiai per assertion segment: the segments order the
    lines a failing test alone runs (all 1 per test) without overruling the per-test spectrum (a value
    computed before a passing assertion and checked after it is in a passing segment)."""
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    for rel, lines in counts.items():
        for line, (ef, ep, sef, sep) in lines.items():
            s = ochiai(ef, ep, n_failed)
            if s <= 0:
                continue
            s += SEGMENT_WEIGHT * ochiai(sef, sep, n_failed)
            scores["lines"][f"{rel}:{line}"] = s
            scores["files"][rel] = max(scores["files"].get(rel, 0.0), s)
            key = function_key(index, rel, line)
            scores["functions"][key] = max(scores["functions"].get(key, 0.0), s)
    return scores
