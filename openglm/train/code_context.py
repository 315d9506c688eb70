"""Code-context labels of Python source, for evaluating MoE routing only (the model never sees them): a category for
every character from the standard library's own `tokenize` and `ast`, and for every BPE token the category of its
first non-blank character (a token of blanks only is "layout").

Context categories (`CONTEXT`), the innermost construct winning:
  comment    a `#` comment
  docstring  the string that opens a module, class or function body
  string     any other string literal (f-strings whole)
  import     an `import` / `from ... import` statement
  decorator  an `@...` line
  signature  a `def` / `class` header: name, parameters, defaults, annotations, bases (up to the body)
  call_args  inside a call's parentheses
  control    a compound statement's header (`if`/`elif`/`else`/`for`/`while`/`with`/`try`/`except`/`finally`/`match`)
             and `return`/`raise`/`assert`/`break`/`continue` statements
  code       any other code (assignments, expression statements, ...)
  layout     blanks: newlines and indentation
Lexical categories (`LEXICAL`), from the `tokenize` token a character belongs to: keyword, identifier, operator,
number, string, comment, layout.
Document kinds (`DOCUMENT_KINDS`), one per file: test, package_init, script (runs under `__main__`), module.
"""

from __future__ import annotations

import ast
import io
import keyword
import tokenize
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np

CONTEXT = ("layout", "comment", "docstring", "string", "import", "decorator", "signature", "call_args", "control",
           "code")
LEXICAL = ("layout", "keyword", "identifier", "operator", "number", "string", "comment")
DOCUMENT_KINDS = ("module", "package_init", "script", "test")
_C = {name: i for i, name in enumerate(CONTEXT)}
_L = {name: i for i, name in enumerate(LEXICAL)}
_HEADERS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.ExceptHandler)
_FLOW = (ast.Return, ast.Raise, ast.Assert, ast.Break, ast.Continue)
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BARE_HEADERS = {"else", "finally", "try"}  # header keywords with no expression of their own (painted from tokens)


class LabelError(ValueError):
    """The source cannot be labelled (it does not parse or tokenize)."""


@dataclass
class Labels:
    context: np.ndarray  # [n] int8 indices into CONTEXT
    lexical: np.ndarray  # [n] int8 indices into LEXICAL


def char_labels(source: str) -> Labels:
    """The context and lexical category of every character of `source`. Raises LabelError when the source does not
    parse, or uses bare carriage returns (whose line numbering `ast` and `tokenize` do not share)."""
    if "\r" in source.replace("\r\n", ""):
        raise LabelError("bare carriage returns")
    source = source.replace("\r\n", "\n")
    try:
        tree = ast.parse(source)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, ValueError, tokenize.TokenError) as e:
        raise LabelError(f"not parseable Python: {e}") from None
    pos = _Positions(source)
    context = np.full(len(source), _C["code"], dtype=np.int8)
    for start, end, name in sorted(_ast_spans(tree, pos), key=lambda s: s[0] - s[1]):  # outermost first
        context[start:end] = _C[name]
    lexical = np.full(len(source), _L["layout"], dtype=np.int8)
    significant = [t for t in tokens if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                                       tokenize.DEDENT, tokenize.ENDMARKER)]
    for i, tok in enumerate(significant):
        start, end = pos.of_token(tok.start), pos.of_token(tok.end)
        lexical[start:end] = _L[_lexical(tok)]
        if tok.type == tokenize.COMMENT:
            context[start:end] = _C["comment"]
        elif tok.type == tokenize.STRING:
            context[start:end] = _C["string"]
        elif tok.string in _BARE_HEADERS and i + 1 < len(significant) and significant[i + 1].string == ":":
            context[start:pos.of_token(significant[i + 1].end)] = _C["control"]  # the keyword and its colon
    for start, end in _docstrings(tree, pos):
        context[start:end] = _C["docstring"]
    return Labels(context, lexical)


def token_labels(source: str, offsets: list[tuple[int, int]]) -> Labels:
    """The labels of BPE tokens with these character `offsets` (start, end) into `source`."""
    chars = char_labels(source)
    n = len(source)
    blank = np.frombuffer(source.encode("utf-32-le"), dtype=np.uint32) if n else np.zeros(0, np.uint32)
    blank = np.isin(blank, [ord(c) for c in " \t\n\r\f\v"])
    # next_visible[i]: the first non-blank character at or after i (n if none)
    next_visible = np.where(blank, n, np.arange(n))
    next_visible = np.minimum.accumulate(next_visible[::-1])[::-1] if n else next_visible
    next_visible = np.append(next_visible, n)
    starts = np.clip(np.array([s for s, _ in offsets], dtype=np.int64), 0, n)
    ends = np.array([e for _, e in offsets], dtype=np.int64)
    first = next_visible[starts]
    visible = first < np.minimum(ends, n)
    at = np.where(visible, first, 0)
    context = np.where(visible, chars.context[at] if n else 0, _C["layout"]).astype(np.int8)
    lexical = np.where(visible, chars.lexical[at] if n else 0, _L["layout"]).astype(np.int8)
    return Labels(context, lexical)


def document_kind(name: str, source: str) -> str:
    """One of DOCUMENT_KINDS for the file `name` (a relative path) with this source."""
    path = PurePosixPath(name)
    if any(part.startswith("test") for part in path.parts[:-1]) or path.name.startswith("test_"):
        return "test"
    if path.name == "__init__.py":
        return "package_init"
    if "__name__ == '__main__'" in source or '__name__ == "__main__"' in source:
        return "script"
    return "module"


class _Positions:
    """Character offsets of (line, column) positions: `ast` columns count UTF-8 bytes, `tokenize` ones characters."""

    def __init__(self, source: str):
        self.lines = source.split("\n")
        self.starts = np.concatenate([[0], np.cumsum([len(line) + 1 for line in self.lines])]).tolist()
        self.size = len(source)

    def of_token(self, position: tuple[int, int]) -> int:
        row, col = position
        return min(self.starts[row - 1] + col, self.size) if row <= len(self.lines) else self.size

    def of_node(self, row: int, col_bytes: int) -> int:
        line = self.lines[row - 1]
        col = col_bytes if line.isascii() else len(line.encode("utf-8")[:col_bytes].decode("utf-8", errors="ignore"))
        return self.starts[row - 1] + col

    def start(self, node) -> int:
        return self.of_node(node.lineno, node.col_offset)

    def end(self, node) -> int:
        return self.of_node(node.end_lineno, node.end_col_offset)

    def line_start(self, row: int) -> int:
        line = self.lines[row - 1]
        return self.starts[row - 1] + len(line) - len(line.lstrip())


def _ast_spans(tree: ast.AST, pos: _Positions):
    """(start, end, category) of every construct the tree gives a span to."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield pos.start(node), pos.end(node), "import"
        elif isinstance(node, _DEFS):
            yield pos.start(node), pos.start(node.body[0]), "signature"
            for d in node.decorator_list:
                yield pos.line_start(d.lineno), pos.end(d), "decorator"
        elif isinstance(node, ast.Call):
            yield pos.end(node.func), pos.end(node), "call_args"
        elif isinstance(node, _HEADERS):
            yield pos.start(node), pos.start(node.body[0]), "control"
        elif isinstance(node, ast.Match):
            yield pos.start(node), pos.end(node.subject), "control"
        elif isinstance(node, _FLOW):
            yield pos.start(node), pos.end(node), "control"


def _docstrings(tree: ast.AST, pos: _Positions):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module,) + _DEFS) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                yield pos.start(value), pos.end(value)


def _lexical(tok: tokenize.TokenInfo) -> str:
    if tok.type == tokenize.NAME:
        return "keyword" if keyword.iskeyword(tok.string) else "identifier"
    return {tokenize.OP: "operator", tokenize.NUMBER: "number", tokenize.STRING: "string",
            tokenize.COMMENT: "comment"}.get(tok.type, "layout")
