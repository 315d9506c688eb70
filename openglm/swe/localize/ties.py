"""Order lines of equal score by what tells them apart, not by line number.

When only the failing tests run a function, all its lines score alike (Ochiai 1), and the lowest
line numbers - a long function's first lines - would fill the top 5. Among equal scores:
- the statement kind: lines that compute or decide (a condition, a return value, an assignment, a
  call) before structure (`def`, `try:`, `else:`, imports, docstrings, `pass`);
- recency: the line's last change in git history (`git blame`), newer first; a bug fix usually
  touches code changed not long before.
Each gives a value in [0, 1]; the tie value is their weighted sum (kind first).
"""

from __future__ import annotations

import ast
from pathlib import Path

from openglm.retrieval.spans import FunctionIndex
from openglm.util.git import git

KIND_WEIGHT, RECENCY_WEIGHT = 1.0, 0.5
_DECIDES = (ast.If, ast.While, ast.Return, ast.Raise, ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign,
            ast.Expr, ast.Delete, ast.Yield, ast.YieldFrom)
_LOOPS = (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)
_STRUCTURE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Pass,
              ast.Break, ast.Continue, ast.Global, ast.Nonlocal, ast.Try)


def statement_kinds(source: str) -> dict[int, float]:
    """{line: weight of the statement that starts on it, or that the line continues}."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    out: dict[int, float] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            weight = 0.0  # a docstring
        elif isinstance(node, _DECIDES):
            weight = 1.0
        elif isinstance(node, _LOOPS):
            weight = 0.6
        elif isinstance(node, _STRUCTURE):
            weight = 0.1
        else:
            weight = 0.5
        # a compound statement's own lines are its header; its body's statements set theirs
        last = node.body[0].lineno - 1 if hasattr(node, "body") and isinstance(node.body, list) and node.body \
            else node.end_lineno or node.lineno
        for line in range(node.lineno, max(last, node.lineno) + 1):
            out.setdefault(line, weight)
    return out


def blame_times(repo: Path, rel: str) -> dict[int, int]:
    """{line: commit time of its last change} for the working tree's file (uncommitted lines: now)."""
    out = git(repo, "blame", "--porcelain", "-w", "--", rel, check=False)
    times: dict[str, int] = {}
    lines: dict[int, int] = {}
    sha, final = None, 0
    for row in out.splitlines():
        parts = row.split()
        if len(parts) >= 3 and len(parts[0]) == 40 and parts[1].isdigit():
            sha, final = parts[0], int(parts[2])
        elif row.startswith("committer-time ") and sha:
            times[sha] = int(parts[1])
        elif row.startswith("\t") and sha:
            lines[final] = times.get(sha, 2 ** 31) if set(sha) != {"0"} else 2 ** 31
    return lines


def _recency(times: dict[int, int]) -> dict[int, float]:
    """Rank of each line's change time within its file, in [0, 1] (newest = 1)."""
    order = sorted(set(times.values()))
    if len(order) < 2:
        return {line: 0.0 for line in times}
    rank = {t: i / (len(order) - 1) for i, t in enumerate(order)}
    return {line: rank[t] for line, t in times.items()}


def tie_breaks(repo: Path, index: FunctionIndex, line_scores: dict[str, float], top: int) -> dict[str, float]:
    """{line key: tie value} for the lines whose score ties with another's near the top."""
    best = sorted(line_scores.values(), reverse=True)[: max(top, 5) * 4]
    if not best:
        return {}
    floor = best[-1]
    tied: dict[str, list[int]] = {}
    seen: dict[float, int] = {}
    for s in line_scores.values():
        seen[round(s, 9)] = seen.get(round(s, 9), 0) + 1
    for key, s in line_scores.items():
        if s >= floor and seen[round(s, 9)] > 1:
            rel, _, line = key.rpartition(":")
            tied.setdefault(rel, []).append(int(line))
    out: dict[str, float] = {}
    for rel, lines in tied.items():
        kinds = statement_kinds(index.sources.get(rel, ""))
        recency = _recency(blame_times(repo, rel)) if (repo / ".git").exists() else {}
        for line in lines:
            out[f"{rel}:{line}"] = KIND_WEIGHT * kinds.get(line, 0.5) + RECENCY_WEIGHT * recency.get(line, 0.0)
    return out
