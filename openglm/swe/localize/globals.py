"""Module-level data the suspicious code reads: a wrong constant (`RATE = 0.2`) is executed at
import time, outside every test, so the spectrum never sees it; the lines reading it do. A module-level
assignment (not an import, def or class) of a name that suspicious lines of the same file load
inherits a share of their score, as a line and as the file's `<module>` candidate."""

from __future__ import annotations

import ast

from openglm.retrieval.spans import FunctionIndex

SHARE = 0.8  # of the best score among the lines reading the name


def module_assignments(source: str) -> dict[str, list[int]]:
    """{name: lines of its module-level assignments} (plain, annotated and augmented)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    out: dict[str, list[int]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = [node.target]
        else:
            continue
        lines = list(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    out.setdefault(n.id, []).extend(lines)
    return out


def loaded_names(source: str) -> dict[int, set[str]]:
    """{line: names loaded on it}."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    out: dict[int, set[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.setdefault(n.lineno, set()).add(n.id)
    return out


def global_scores(index: FunctionIndex, line_scores: dict[str, float], module: str) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    by_file: dict[str, dict[int, float]] = {}
    for key, s in line_scores.items():
        rel, _, line = key.rpartition(":")
        by_file.setdefault(rel, {})[int(line)] = s
    for rel, lines in by_file.items():
        source = index.sources.get(rel)
        if not source:
            continue
        assigned = module_assignments(source)
        if not assigned:
            continue
        loads = loaded_names(source)
        best: dict[str, float] = {}
        for line, s in lines.items():
            for name in loads.get(line, ()):
                if name in assigned and line not in assigned[name]:
                    best[name] = max(best.get(name, 0.0), s)
        for name, s in best.items():
            for line in assigned[name]:
                key = f"{rel}:{line}"
                scores["lines"][key] = max(scores["lines"].get(key, 0.0), SHARE * s)
            fkey = f"{rel}::{module}"
            scores["functions"][fkey] = max(scores["functions"].get(fkey, 0.0), SHARE * s)
    return scores
