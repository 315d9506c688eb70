"""An index of the functions in a repository: where each one starts and ends, and which
function (innermost) holds a given line. Localisation ranks these; the repo map uses them too."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {".git", ".venv", "venv", "env", "node_modules", "__pycache__", "build", "dist", ".tox",
             ".eggs", ".bench", ".mypy_cache", ".pytest_cache"}


@dataclass(frozen=True)
class Function:
    path: str  # relative to the repo root, with forward slashes
    qualname: str  # Class.method, outer.inner
    start: int  # first line (decorators excluded)
    end: int

    @property
    def key(self) -> str:
        return f"{self.path}::{self.qualname}"


def python_files(repo: Path) -> list[Path]:
    files = []
    for p in sorted(repo.rglob("*.py")):
        if not SKIP_DIRS.intersection(p.relative_to(repo).parts[:-1]):
            files.append(p)
    return files


def is_test_path(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or any(p in ("tests", "test", "testing") for p in parts[:-1]))


def functions_with_qualnames(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) for every function and method, in source order."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + child.name, child))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif not isinstance(child, ast.expr):
                visit(child, prefix)  # functions inside if/try blocks at module level

    visit(tree, "")
    return out


def functions_in_source(source: str, rel: str) -> list[Function]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [Function(rel, q, node.lineno, node.end_lineno or node.lineno)
            for q, node in functions_with_qualnames(tree)]


class CodeIndex:
    """Functions of every Python file under `repo` (tests included unless asked otherwise)."""

    def __init__(self, repo: str | Path, include_tests: bool = True):
        self.repo = Path(repo).resolve()
        self.functions: dict[str, list[Function]] = {}
        self.sources: dict[str, str] = {}
        for p in python_files(self.repo):
            rel = p.relative_to(self.repo).as_posix()
            if not include_tests and is_test_path(rel):
                continue
            try:
                text = p.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            self.sources[rel] = text
            self.functions[rel] = functions_in_source(text, rel)

    def rel(self, path: str | Path) -> str | None:
        """Repo-relative form of an absolute or relative path, or None if outside the repo."""
        p = Path(path)
        if not p.is_absolute():
            p = self.repo / p
        try:
            return p.resolve().relative_to(self.repo).as_posix()
        except (ValueError, OSError):
            return None

    def function_at(self, rel: str, line: int) -> Function | None:
        best = None
        for f in self.functions.get(rel, []):
            if f.start <= line <= f.end and (best is None or f.start >= best.start):
                best = f  # innermost: the latest-starting function that still contains the line
        return best

    def all_functions(self) -> list[Function]:
        return [f for fs in self.functions.values() for f in fs]
