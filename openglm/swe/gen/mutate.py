"""AST mutations that inject one small bug into a function, edited in place in the source text.

Each mutation rewrites only the characters of one operator, constant or argument pair (or deletes
one single-line statement), so the diff between clean and buggy code is one line, as a human bug
would be. Kinds: flip_compare, off_by_one, wrong_operator, swap_args, drop_statement, wrong_constant.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

_COMPARE_FLIP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
                 ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"),
                 ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
_BINOP_SWAP = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.Div: ("/", "*"),
               ast.FloorDiv: ("//", "*"), ast.Mod: ("%", "//"), ast.BitAnd: ("&", "|"),
               ast.BitOr: ("|", "&"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<")}
_BOOLOP_SWAP = {ast.And: ("and", "or"), ast.Or: ("or", "and")}


@dataclass(frozen=True)
class Mutation:
    kind: str
    line: int  # 1-based line of the edit in the clean file
    start: int  # character span on that line that is replaced
    end: int
    new: str  # replacement text ("" with drop_statement deletes the whole line)
    description: str

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        text = lines[self.line - 1]
        if self.kind == "drop_statement":
            del lines[self.line - 1]
        else:
            lines[self.line - 1] = text[:self.start] + self.new + text[self.end:]
        return "".join(lines)


def _col(line: str, byte_offset: int) -> int:
    """ast offsets count UTF-8 bytes; convert to a character index."""
    return len(line.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore"))


def _gap_op(lines, left: ast.AST, right: ast.AST, old: str, new: str, kind: str, desc: str):
    """Replace the operator token `old` between two sub-expressions on the same line."""
    if left.end_lineno != right.lineno:
        return None
    text = lines[right.lineno - 1]
    a, b = _col(text, left.end_col_offset), _col(text, right.col_offset)
    gap = text[a:b]
    word = r"\b" if old[0].isalpha() else ""
    m = re.search(rf"(?<![=<>!*/]){word}{re.escape(old)}{word}(?![=<>*/])", gap)
    if not m:
        return None
    return Mutation(kind, right.lineno, a + m.start(), a + m.end(), new, desc)


def _segment(lines, node: ast.AST, new: str, kind: str, desc: str):
    if node.lineno != node.end_lineno:
        return None
    text = lines[node.lineno - 1]
    return Mutation(kind, node.lineno, _col(text, node.col_offset), _col(text, node.end_col_offset),
                    new, desc)


def mutations_of(source: str, func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Mutation]:
    """Every mutation available inside one function's body (nested functions excluded)."""
    lines = source.splitlines()
    out: list[Mutation | None] = []
    for node in _own_nodes(func):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_FLIP:
            old, new = _COMPARE_FLIP[type(node.ops[0])]
            out.append(_gap_op(lines, node.left, node.comparators[0], old, new, "flip_compare",
                               f"`{old}` -> `{new}`"))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            old, new = _BINOP_SWAP[type(node.op)]
            out.append(_gap_op(lines, node.left, node.right, old, new, "wrong_operator",
                               f"`{old}` -> `{new}`"))
        elif isinstance(node, ast.BoolOp) and type(node.op) in _BOOLOP_SWAP:
            old, new = _BOOLOP_SWAP[type(node.op)]
            out.append(_gap_op(lines, node.values[0], node.values[1], old, new, "wrong_operator",
                               f"`{old}` -> `{new}`"))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            out.append(_segment(lines, node, str(not node.value), "wrong_constant",
                                f"`{node.value}` -> `{not node.value}`"))
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 1000:
            delta = 1 if node.value == 0 or node.lineno % 2 else -1  # deterministic direction
            out.append(_segment(lines, node, str(node.value + delta), "off_by_one",
                                f"`{node.value}` -> `{node.value + delta}`"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and not any(
                isinstance(a, ast.Starred) for a in node.args[:2]):
            out.append(_swap(lines, node.args[0], node.args[1]))
        elif isinstance(node, ast.stmt):
            out.append(_drop(lines, node))
    return [m for m in out if m is not None]


def _swap(lines, a: ast.AST, b: ast.AST):
    if not (a.lineno == a.end_lineno == b.lineno == b.end_lineno):
        return None
    text = lines[a.lineno - 1]
    a0, a1 = _col(text, a.col_offset), _col(text, a.end_col_offset)
    b0, b1 = _col(text, b.col_offset), _col(text, b.end_col_offset)
    if text[a0:a1] == text[b0:b1]:
        return None
    new = text[b0:b1] + text[a1:b0] + text[a0:a1]
    return Mutation("swap_args", a.lineno, a0, b1, new, f"swapped `{text[a0:a1]}` and `{text[b0:b1]}`")


_DROPPABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)


def _drop(lines, stmt: ast.stmt):
    """Delete a one-line statement whose block keeps at least one other statement."""
    parent_body = getattr(stmt, "_openglm_block", None)
    if not isinstance(stmt, _DROPPABLE) or stmt.lineno != stmt.end_lineno or not parent_body:
        return None
    if len(parent_body) < 2 or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
        return None  # an empty block would not compile; docstrings are not code
    text = lines[stmt.lineno - 1]
    if text.strip() != ast.get_source_segment("\n".join(lines), stmt) or ";" in text:
        return None
    return Mutation("drop_statement", stmt.lineno, 0, len(text), "", f"dropped `{text.strip()}`")


def _own_nodes(func):
    """Nodes of `func` outside nested functions/classes; statements learn their enclosing block."""
    stack = [func]
    while stack:
        node = stack.pop()
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                for s in block:
                    s._openglm_block = block
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            yield child
            stack.append(child)
