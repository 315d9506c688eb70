"""Chunk boundaries on real standard-library files."""

import ast
import dataclasses
import functools
import json.decoder
import textwrap
import typing
from pathlib import Path

import pytest

from openglm.retrieval.chunking import chunk_file, chunk_python, iter_source_files

STDLIB_FILES = [textwrap.__file__, functools.__file__, json.decoder.__file__, dataclasses.__file__]


def definitions(tree, prefix=""):
    """(qualified name, first line incl. decorators, last line, kind) of every def/class member."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if isinstance(node, ast.ClassDef):
                yield prefix + node.name, start, node.end_lineno, "class"
                yield from definitions(node, prefix + node.name + ".")
            else:
                yield prefix + node.name, start, node.end_lineno, "method" if prefix else "function"


@pytest.mark.parametrize("filename", STDLIB_FILES, ids=lambda f: Path(f).name)
def test_python_chunks_follow_the_syntax_tree(filename):
    text = Path(filename).read_text()
    chunks = chunk_python(Path(filename).name, text)
    by_name = {}
    for c in chunks:
        by_name.setdefault((c.name, c.kind), []).append(c)
    for name, start, end, kind in definitions(ast.parse(text)):
        parts = by_name[(name, kind)]
        assert parts[0].start_line == start, name  # starts at the first decorator
        if kind != "class":
            assert parts[-1].end_line == end, name  # ... and ends at the last line of the body
    lines = text.splitlines()
    for c in chunks:
        assert c.text == "\n".join(lines[c.start_line - 1:c.end_line])
    # Every non-blank line belongs to some chunk.
    covered = set()
    for c in chunks:
        covered.update(range(c.start_line, c.end_line + 1))
    missing = [i + 1 for i, line in enumerate(lines) if line.strip() and i + 1 not in covered]
    assert missing == []


def test_method_chunk_has_qualified_name_docstring_and_span():
    text = Path(textwrap.__file__).read_text()
    chunks = chunk_python("textwrap.py", text)
    (wrap_chunks,) = [c for c in chunks if c.name == "TextWrapper._wrap_chunks"]
    assert wrap_chunks.kind == "method"
    assert wrap_chunks.text.lstrip().startswith("def _wrap_chunks(self, chunks):")
    assert '"""_wrap_chunks(chunks : [string]) -> [string]' in wrap_chunks.text
    assert wrap_chunks.location == f"textwrap.py:{wrap_chunks.start_line}-{wrap_chunks.end_line}"
    cls = min((c for c in chunks if c.name == "TextWrapper" and c.kind == "class"), key=lambda c: c.start_line)
    assert cls.text.startswith("class TextWrapper:") and "def " not in cls.text
    assert "Object for wrapping/filling text." in cls.text
    # A decorated definition's chunk starts at its decorator and has no other chunk's lines.
    ftext = Path(typing.__file__).read_text()
    decorated = [n for n in ast.walk(ast.parse(ftext))
                 if isinstance(n, ast.FunctionDef) and n.decorator_list and n.col_offset == 0]
    assert decorated
    fchunks = {c.name: c for c in chunk_python("typing.py", ftext)}
    for node in decorated:
        assert fchunks[node.name].text.startswith("@"), node.name


def test_text_and_unparsable_files_use_line_windows():
    text = "\n".join(f"line {i}" for i in range(1, 101))
    spans = [(c.start_line, c.end_line) for c in chunk_file("notes.md", text)]
    assert spans == [(1, 40), (31, 70), (61, 100)]
    broken = "def f(:\n    pass\n"
    (chunk,) = chunk_file("broken.py", broken)
    assert (chunk.kind, chunk.start_line, chunk.end_line) == ("text", 1, 2)


def test_repository_walk_skips_hidden_binary_and_cache_folders(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.py").write_text("x = 1\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config.txt").write_text("x\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\0")
    assert [p.relative_to(tmp_path).as_posix() for p in iter_source_files(tmp_path)] == ["pkg/a.py"]
