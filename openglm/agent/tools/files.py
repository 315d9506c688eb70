"""File tools: view, create, edit — confined to the workspace.

Every path is resolved with symlinks followed; anything that lands outside the workspace
(`../x`, `/etc/passwd`, a symlink pointing out) is refused with PathEscape.
"""

from __future__ import annotations

import os
from pathlib import Path

from openglm.agent.tools.shell import truncate
from openglm.util.files import write_atomic


class ToolError(ValueError):
    """A tool call the agent got wrong; the message goes back to the model as the observation."""


class PathEscape(ToolError):
    pass


def confine(workspace: str | Path, path: str) -> Path:
    root = Path(os.path.realpath(workspace))
    if not isinstance(path, str) or not path:
        raise ToolError("path must be a non-empty string")
    target = Path(os.path.realpath(root / path))  # follows every symlink on the way
    if target != root and root not in target.parents:
        raise PathEscape(f"path {path!r} resolves outside the workspace; refused")
    return target


def view(workspace, path: str = ".", start: int | None = None, end: int | None = None, max_chars: int = 20000) -> str:
    target = confine(workspace, path)
    if target.is_dir():
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir() if p.name != ".git")
        return truncate("\n".join(entries) or "(empty directory)", max_chars)
    if not target.exists():
        raise ToolError(f"{path}: no such file or directory")
    lines = target.read_text(errors="replace").splitlines()
    lo = max(1, start or 1)
    hi = min(len(lines), end or len(lines))
    return truncate("\n".join(f"{i:6d}\t{lines[i - 1]}" for i in range(lo, hi + 1)), max_chars)


def create(workspace, path: str, content: str, overwrite: bool = False) -> str:
    target = confine(workspace, path)
    if target.exists() and not overwrite:
        raise ToolError(f"{path} already exists (use edit, or create with overwrite=true)")
    if not isinstance(content, str):
        raise ToolError("content must be a string")
    write_atomic(target, content, keep_mode=True)
    return f"created {path} ({len(content)} characters)"


def edit(workspace, path: str, old: str, new: str) -> str:
    target = confine(workspace, path)
    if not target.is_file():
        raise ToolError(f"{path}: no such file")
    text = target.read_text()
    count = text.count(old) if old else 0
    if count != 1:
        raise ToolError(f"{path}: `old` must occur exactly once, found {count} occurrences")
    write_atomic(target, text.replace(old, new, 1), keep_mode=True)
    return f"edited {path}"
