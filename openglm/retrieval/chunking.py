"""Split a repository into retrievable chunks, each with its path and line span.

Python files are cut along the syntax tree: one chunk per function, per method and per class
header (the class line, its docstring and class-level statements up to the first method), each
carrying its qualified name (`TextWrapper._wrap_chunks`). Module-level code between definitions
becomes `module` chunks. Everything else (and Python that does not parse) is cut into line windows.
"""

from __future__ import annotations

import ast
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .spans import SKIP_DIRS, CodeSpan, definitions

# Files worth indexing; anything else (images, archives, lock files...) is skipped.
TEXT_SUFFIXES = {
    ".py", ".pyi", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".json",
    ".sh", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".js", ".ts", ".go", ".rs", ".java", ".sql",
}
MAX_FILE_BYTES = 1_000_000
WINDOW_LINES = 40  # line-window chunk size for non-Python text
WINDOW_STRIDE = 30  # overlap of 10 lines so a match near a boundary is not cut in half
MAX_CHUNK_LINES = 200  # longer definitions are split so lexical matches stay local


@dataclass(frozen=True)
class Chunk(CodeSpan):
    """A span with its text (definitions start at their first decorator)."""

    text: str

    def embed_text(self) -> str:
        """What the embedder and BM25 see: location and name first, then the code."""
        head = f"{self.path} {self.kind} {self.name}".rstrip()
        return f"{head}\n{self.text}"


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_source_files(root: str | Path, suffixes: set[str] | None = None):
    """Yield indexable files under `root` (sorted, so builds are deterministic)."""
    root = Path(root)
    suffixes = suffixes or TEXT_SUFFIXES
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix.lower() in suffixes and not path.is_symlink():
                try:
                    if path.stat().st_size <= MAX_FILE_BYTES:
                        yield path
                except OSError:
                    continue


def decode_text(data: bytes) -> str | None:
    """Source text, or None for binary content (a NUL byte in the first 8 KiB)."""
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def chunk_file(rel_path: str, text: str) -> list[Chunk]:
    if rel_path.endswith((".py", ".pyi")):
        try:
            return chunk_python(rel_path, text)
        except (SyntaxError, ValueError, RecursionError):
            pass  # Python 2 files, templates...: fall back to line windows
    lines = text.splitlines()
    return chunk_lines(rel_path, lines, 1, len(lines), "text", "")


def chunk_lines(path: str, lines: list[str], start: int, end: int, kind: str, name: str,
                size: int = WINDOW_LINES, stride: int = WINDOW_STRIDE) -> list[Chunk]:
    """Line windows over lines[start-1:end] (1-based inclusive), skipping blank-only windows."""
    chunks = []
    first = start
    while first <= end:
        last = min(first + size - 1, end)
        body = "\n".join(lines[first - 1:last])
        if body.strip():
            chunks.append(Chunk(path, first, last, kind, name, body))
        if last == end:
            break
        first += stride
    return chunks


def _first_line(node: ast.AST) -> int:
    """A definition starts at its first decorator, not at `def`."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


def _definition(path, lines, node, qualname, kind) -> list[Chunk]:
    start, end = _first_line(node), node.end_lineno
    if end - start + 1 <= MAX_CHUNK_LINES:
        return [Chunk(path, start, end, kind, qualname, "\n".join(lines[start - 1:end]))]
    return chunk_lines(path, lines, start, end, kind, qualname, MAX_CHUNK_LINES, MAX_CHUNK_LINES - 20)


def _gaps(path, lines, covered, lo, hi, kind, name) -> list[Chunk]:
    """Line windows over the parts of lines lo..hi that no definition covers."""
    chunks, start = [], lo
    for a, b in sorted(covered) + [(hi + 1, hi + 1)]:
        if a > start:
            chunks += chunk_lines(path, lines, start, min(a - 1, hi), kind, name)
        start = max(start, b + 1)
    return chunks


def _walk_body(path, lines, defs) -> tuple[list[Chunk], list[tuple[int, int]]]:
    """Chunks of the definitions `defs` (one body's) and the line ranges they cover."""
    chunks, covered = [], []
    for d in defs:
        node = d.node
        if d.kind != "class":
            chunks += _definition(path, lines, node, d.qualname, d.kind)
            covered.append((_first_line(node), node.end_lineno))
        else:
            qual = d.qualname
            inner, inner_cov = _walk_body(path, lines, d.members)
            start = _first_line(node)
            # The class chunk: header, docstring and class-level statements before the first
            # member definition; members get their own chunks, statements between them too.
            head_end = inner_cov[0][0] - 1 if inner_cov else node.end_lineno
            while head_end > start and not lines[head_end - 1].strip():
                head_end -= 1
            chunks.append(Chunk(path, start, head_end, "class", qual, "\n".join(lines[start - 1:head_end])))
            chunks += inner + _gaps(path, lines, inner_cov + [(start, head_end)], start, node.end_lineno,
                                    "class", qual)
            covered.append((start, node.end_lineno))
    return chunks, covered


def chunk_python(path: str, text: str) -> list[Chunk]:
    tree = ast.parse(text)
    lines = text.splitlines()
    chunks, covered = _walk_body(path, lines, definitions(tree.body, blocks=False))
    # Module-level code between definitions (imports, constants, module docstring, scripts).
    chunks += _gaps(path, lines, covered, 1, len(lines), "module", "")
    return sorted(chunks, key=lambda c: (c.start_line, c.end_line))
