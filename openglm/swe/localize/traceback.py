"""Traceback analysis: the frames named in a failure's output, deepest (closest to the raise) first.

Understands Python's native format (`File "x.py", line 3, in f`) and pytest's (`x.py:3: in f`,
and the closing `x.py:3: ValueError`). Frames in test files are kept out of the ranking: the bug is
rarely in the test that reports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from openglm.retrieval.spans import FunctionIndex, is_test_path

_NATIVE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PYTEST = re.compile(r"^(\S+\.py):(\d+): (?:in (\S+)|(\w[\w.]*(?:Error|Exception|Warning|Exit)\b|\w+))",
                     re.M)


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str


def parse_frames(text: str) -> list[Frame]:
    """All frames in order of appearance (outermost first within each traceback)."""
    found: list[tuple[int, Frame]] = []
    for m in _NATIVE.finditer(text):
        found.append((m.start(), Frame(m.group(1), int(m.group(2)), m.group(3))))
    for m in _PYTEST.finditer(text):
        found.append((m.start(), Frame(m.group(1), int(m.group(2)), m.group(3) or "")))
    return [f for _, f in sorted(found, key=lambda t: t[0])]


def traceback_scores(index: FunctionIndex, texts: list[str]) -> dict[str, dict[str, float]]:
    """{"files"|"functions"|"lines": {key: score}}; the deepest repo frame of each text scores 1,
    the one above it 1/2, and so on; scores from several texts add up."""
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    for text in texts:
        frames = []
        for fr in parse_frames(text):
            rel = index.rel(fr.path)
            if rel is None or rel not in index.sources or is_test_path(rel):
                continue
            frames.append((rel, fr.line))
        seen = set()
        for rel, line in reversed(frames):
            if (rel, line) in seen:
                continue
            seen.add((rel, line))
            s = 1.0 / len(seen)
            _add(scores["lines"], f"{rel}:{line}", s)
            _add(scores["files"], rel, s)
            fn = index.function_at(rel, line)
            if fn is not None:
                _add(scores["functions"], fn.key, s)
    return scores


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value
