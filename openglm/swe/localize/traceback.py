"""Traceback analysis: the frames named in a failure's output, deepest (closest to the raise) first,
and the names a failing test could not import.

Understands Python's native format (`File "x.py", line 3, in f`) and pytest's (`x.py:3: in f`,
and the closing `x.py:3: ValueError`). Frames in test files are kept out of the ranking: the bug is
rarely in the test that reports it.

A test module that does not import (it imports what the fix adds or renames) runs no test, so it
leaves no coverage; its ImportError still says where to look: `cannot import name 'X' from 'pkg.mod'
(/path/pkg/mod.py)` names the module that lacks X, and the functions there whose names share words
with X are the likeliest to change. A test that patches a name the module lacks (`mock.patch`'s
`does not have the attribute 'X'`) fails the same way, before it runs any code of the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from openglm.retrieval.spans import FunctionIndex, is_test_path
from openglm.swe.localize.text import tokens

_NATIVE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PYTEST = re.compile(r"^(\S+\.py):(\d+): (?:in (\S+)|(\w[\w.]*(?:Error|Exception|Warning|Exit)\b|\w+))",
                     re.M)
_CANNOT_IMPORT = re.compile(r"cannot import name '(\w+)' from '([\w.]+)'(?: \(([^)]+)\))?")
_NO_ATTRIBUTE = re.compile(r"module '([\w.]+)' has no attribute '(\w+)'")
# mock.patch of a name the module lacks: `<module 'pkg.mod' from '/p/pkg/mod.py'> does not have the attribute 'x'`
_MOCK_MISSING = re.compile(r"<module '([\w.]+)' from '([^']+)'> does not have the attribute '(\w+)'")
# a method the test calls and the class lacks: `'YoutubeIE' object has no attribute '_extract_chapters'`
_NO_METHOD = re.compile(r"(?:'(\w+)' object|type object '(\w+)') has no attribute '(\w+)'")


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


def missing_names(index: FunctionIndex, text: str) -> list[tuple[str, str, str]]:
    """(repo file, missing name, class or "") for each `cannot import name`, `has no attribute` or
    mock's `does not have the attribute` naming a repo module or a repo class."""
    out = []
    for m in _CANNOT_IMPORT.finditer(text):
        rel = (index.rel(m.group(3)) if m.group(3) else None) or module_file(index, m.group(2))
        if rel in index.sources:
            out.append((rel, m.group(1), ""))
    for m in _NO_ATTRIBUTE.finditer(text):
        rel = module_file(index, m.group(1))
        if rel in index.sources:
            out.append((rel, m.group(2), ""))
    for m in _MOCK_MISSING.finditer(text):
        rel = index.rel(m.group(2)) or module_file(index, m.group(1))
        if rel in index.sources:
            out.append((rel, m.group(3), ""))
    for m in _NO_METHOD.finditer(text):
        cls = m.group(1) or m.group(2)
        out += [(rel, m.group(3), cls) for rel in class_files(index, cls)]
    return list(dict.fromkeys(out))


def class_files(index: FunctionIndex, cls: str) -> list[str]:
    """The non-test files defining methods of a class named `cls` (the index knows classes by their methods)."""
    return [rel for rel, fns in index.functions.items()
            if not is_test_path(rel) and any(f.name.split(".")[-2:-1] == [cls] for f in fns)]


def module_file(index: FunctionIndex, module: str) -> str | None:
    """`pkg.mod` -> `pkg/mod.py` or `pkg/mod/__init__.py` (or under src/), if the repo has it."""
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py", f"src/{base}.py", f"src/{base}/__init__.py"):
        if rel in index.sources:
            return rel
    return None


def import_scores(index: FunctionIndex, texts: list[str], module: str) -> dict[str, dict[str, float]]:
    """The module a failing test could not import a name from scores 1 (its module-level code too:
    a new name is usually defined there); its functions score by the words their names share with
    the missing name (`get_new_command` for a missing `get_new_commands`). A method a class lacks:
    the class's file, and its methods by shared words."""
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    for text in texts:
        for rel, name, cls in missing_names(index, text):
            scores["files"][rel] = 1.0
            if not cls:
                scores["functions"][f"{rel}::{module}"] = 1.0
            wanted = set(tokens(name))
            for fn in index.functions.get(rel, []):
                if cls and fn.name.split(".")[-2:-1] != [cls]:
                    continue
                own = set(tokens(fn.name.rsplit(".", 1)[-1]))
                if wanted & own:
                    s = len(wanted & own) / len(wanted | own)
                    scores["functions"][fn.key] = max(scores["functions"].get(fn.key, 0.0), s)
    return scores


def _add(d: dict[str, float], key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value
