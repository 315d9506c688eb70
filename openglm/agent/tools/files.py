"""File tools: view, create, edit — confined to the workspace, bounded in what they read.

Every path is resolved with symlinks followed; anything that lands outside the workspace
(`../x`, `/etc/passwd`, a symlink pointing out) is refused with PathEscape. Only regular files are
read or edited (a FIFO would block the reader forever, a device never ends): each is opened
non-blocking and checked after opening. `view` reads at most what it returns (lines streamed in
bounded pieces, stopping at `max_chars`) and stops at a deadline; `edit` refuses files over
EDIT_MAX_BYTES (it must hold the whole file). The toolbox runs these tools in a thread it can
abandon, so a cancel or a timeout frees the task even from a read the kernel never answers.
"""

from __future__ import annotations

import codecs
import os
import stat
import time
from pathlib import Path

from openglm.agent.tools.shell import truncate
from openglm.util.files import write_atomic

READ_PIECE = 64 << 10  # bytes read at a time (a line longer than this arrives in pieces)
VIEW_DEADLINE_S = 20.0  # a view that scans longer than this (a huge file, a slow disk) stops and says so
MAX_ENTRIES = 5000  # directory entries listed at most
EDIT_MAX_BYTES = 8 << 20


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


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _open_regular(target: Path, path: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of `target`, which must be a regular file (checked on the open descriptor, so a file
    swapped for a FIFO in between is caught; O_NONBLOCK keeps that open from blocking)."""
    try:
        fd = os.open(target, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file or directory") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ToolError(f"{path} is a {_kind(mode)}, not a regular file: refused")
    os.set_blocking(fd, True)
    return fd


def _listing(target: Path, max_chars: int) -> str:
    entries, more = [], False
    with os.scandir(target) as it:
        for entry in it:
            if entry.name == ".git":
                continue
            if len(entries) >= MAX_ENTRIES:
                more = True
                break
            entries.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
    text = "\n".join(sorted(entries)) or "(empty directory)"
    return truncate(text + (f"\n[... more than {MAX_ENTRIES} entries; list a subfolder or use search]" if more
                            else ""), max_chars)


def view(workspace, path: str = ".", start: int | None = None, end: int | None = None, max_chars: int = 20000,
         deadline_s: float = VIEW_DEADLINE_S) -> str:
    """Lines `start`..`end` (1-based, inclusive) with their numbers, at most `max_chars` characters of them."""
    target = confine(workspace, path)
    if target.is_dir():
        return _listing(target, max_chars)
    for name, value in (("start", start), ("end", end)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ToolError(f"{name} must be a line number, got {value!r}")
    lo, hi = max(1, start or 1), end
    out, size, lineno, fresh, cut = [], 0, 1, True, ""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    stop_at = time.monotonic() + deadline_s
    with os.fdopen(_open_regular(target, path), "rb", buffering=READ_PIECE) as f:
        while hi is None or lineno <= hi:
            piece = f.readline(READ_PIECE)
            if not piece:
                break
            if lineno >= lo:
                text = decoder.decode(piece.rstrip(b"\n") if piece.endswith(b"\n") else piece)
                text = (f"{lineno:6d}\t" if fresh else "") + text + ("\n" if piece.endswith(b"\n") else "")
                if size + len(text) > max_chars:
                    out.append(text[: max_chars - size])
                    cut = f"[... output cut at {max_chars} characters (line {lineno}); view from a later line " \
                          "with start/end ...]"
                    break
                out.append(text)
                size += len(text)
            fresh = piece.endswith(b"\n")
            lineno += fresh
            if time.monotonic() > stop_at:
                cut = f"[... stopped after {deadline_s:g} s at line {lineno}: the file is too large to scan; " \
                      "view a range near its start, or use search ...]"
                break
    text = "".join(out).rstrip("\n")
    return f"{text}\n{cut}" if cut else text


def create(workspace, path: str, content: str, overwrite: bool = False) -> str:
    target = confine(workspace, path)
    if not isinstance(content, str):
        raise ToolError("content must be a string")
    if os.path.lexists(target):
        if not overwrite:
            raise ToolError(f"{path} already exists (use edit, or create with overwrite=true)")
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            raise ToolError(f"{path} is a {'directory' if stat.S_ISDIR(mode) else _kind(mode)}: refused")
    write_atomic(target, content, keep_mode=True)
    return f"created {path} ({len(content)} characters)"


def edit(workspace, path: str, old: str, new: str) -> str:
    target = confine(workspace, path)
    if not isinstance(old, str) or not isinstance(new, str):
        raise ToolError("`old` and `new` must be strings")
    with os.fdopen(_open_regular(target, path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > EDIT_MAX_BYTES:
            raise ToolError(f"{path} has {size} bytes, more than the edit tool's {EDIT_MAX_BYTES}: change it "
                            "with a command instead")
        text = f.read(EDIT_MAX_BYTES + 1).decode()
    count = text.count(old) if old else 0
    if count != 1:
        raise ToolError(f"{path}: `old` must occur exactly once, found {count} occurrences")
    write_atomic(target, text.replace(old, new, 1), keep_mode=True)
    return f"edited {path}"
