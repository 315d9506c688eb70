"""Code spans: named line ranges of a repository's files, the one model shared by retrieval and swe.

- `CodeSpan` (path, start_line, end_line, kind, name): a function, method, class, module part or
  text window; `retrieval.chunking.Chunk` adds its text, `retrieval.code_index.Hit` a score.
- `definitions(body)`: the one walker of a Python syntax tree's definitions with qualified names
  (`Class.method`, `outer.inner`).
- `FunctionIndex`: the functions of every Python file of a repository: where each starts and ends,
  and which function (innermost) holds a given line. Localisation ranks these; the repo map uses
  them too.
- `SKIP_DIRS`, `python_files`, `is_test_path`: which files of a repository are code, and tests.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

# Folders that hold no code of the repository itself (VCS data, environments, caches, build output).
SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "env", "node_modules", "__pycache__", "build", "dist", ".tox",
             ".eggs", ".bench", ".mypy_cache", ".pytest_cache", ".openglm-index"}


@dataclass(frozen=True)
class CodeSpan:
    path: str  # relative to the repository root, '/'-separated
    start_line: int  # 1-based, inclusive
    end_line: int  # 1-based, inclusive
    kind: str  # function | method | class | module | text
    name: str  # qualified name for Python definitions ('Class.method', 'outer.inner'), '' otherwise

    @property
    def location(self) -> str:
        return f"{self.path}:{self.start_line}-{self.end_line}"

    @property
    def key(self) -> str:
        return f"{self.path}::{self.name}"


@dataclass
class Definition:
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    kind: str  # function | method | class
    members: list["Definition"] = field(default_factory=list)  # definitions in its body


def definitions(body: list[ast.AST], prefix: str = "", in_class: bool = False, blocks: bool = True) -> list[Definition]:
    """The definitions in `body` in source order, each with its members. `blocks`: also those inside
    if/try/with/for blocks (a function defined under `if TYPE_CHECKING:`)."""
    out = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            is_class = isinstance(node, ast.ClassDef)
            kind = "class" if is_class else "method" if in_class else "function"
            qual = prefix + node.name
            out.append(Definition(qual, node, kind, definitions(node.body, qual + ".", is_class, blocks)))
        elif blocks and not isinstance(node, ast.expr):
            out += definitions(list(ast.iter_child_nodes(node)), prefix, in_class, blocks)
    return out


def function_definitions(tree: ast.Module) -> list[Definition]:
    """Every function and method (nested ones included), in source order."""
    out = []

    def visit(defs):
        for d in defs:
            if d.kind != "class":
                out.append(d)
            visit(d.members)

    visit(definitions(tree.body))
    return out


def functions_with_qualnames(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualname, node) for every function and method, in source order."""
    return [(d.qualname, d.node) for d in function_definitions(tree)]


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


def functions_in_source(source: str, rel: str) -> list[CodeSpan]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [CodeSpan(rel, d.node.lineno, d.node.end_lineno or d.node.lineno, d.kind, d.qualname)
            for d in function_definitions(tree)]


class FunctionIndex:
    """Functions of every Python file under `repo` (tests included unless asked otherwise)."""

    def __init__(self, repo: str | Path, include_tests: bool = True):
        self.repo = Path(repo).resolve()
        self.functions: dict[str, list[CodeSpan]] = {}
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

    def function_at(self, rel: str, line: int) -> CodeSpan | None:
        best = None
        for f in self.functions.get(rel, []):
            if f.start_line <= line <= f.end_line and (best is None or f.start_line >= best.start_line):
                best = f  # innermost: the latest-starting function that still contains the line
        return best

    def all_functions(self) -> list[CodeSpan]:
        return [f for fs in self.functions.values() for f in fs]
