"""Which workspace paths changed since the last look, from inotify (Linux).

`DirtyPaths.drain()` answers {relative path: created since the last settle()} for every path that
was created, written, chmod-ed, deleted or renamed since the previous drain, or None when it cannot
vouch for that: the first drain (nothing is known about the time before the watches existed), a
queue overflow, a directory renamed (the watches' paths are stale), the root moved or deleted, a
watch limit reached, or no inotify at all. None means "rescan everything".

Every directory gets a watch except the user's `.git` and directories whose name the ignore list
always ignores (.venv/, node_modules/...: watches are a per-user limit). A created directory is
reported as a whole: files may appear in it before its watch exists.

Events are queued by the kernel during the system call that causes them, so once a command has
exited, draining sees everything it did. Not seen: writes through an mmap, through a hard link
living outside the watched directories, or from another machine on a shared filesystem.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import sys

INotify = flags = None  # no inotify (not Linux): callers fall back to full rescans
if sys.platform.startswith("linux"):
    from inotify_simple import INotify, flags

if flags is not None:
    MASK = (flags.MODIFY | flags.ATTRIB | flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO
            | flags.MOVE_SELF | flags.DELETE_SELF | flags.ONLYDIR | flags.DONT_FOLLOW)
    CREATED = flags.CREATE | flags.MOVED_TO
    SELF = flags.MOVE_SELF | flags.DELETE_SELF | flags.UNMOUNT


def name_filter(patterns: list[str]):
    """`ignored(name, is_dir)` for the gitignore patterns that ignore a plain name at every level
    (`*.pyc`, `.venv/`). Anything fancier is left to git, and so is everything if a pattern
    negates: a name wrongly taken for ignored would lose its changes, one wrongly kept costs nothing."""
    if any(p.lstrip().startswith("!") for p in patterns):
        return lambda name, is_dir: False
    plain = [(p.rstrip("/"), p.endswith("/")) for p in patterns
             if p and not p.startswith("#") and p == p.strip() and not set(p.rstrip("/")) & set("/\\[")]

    def ignored(name: str, is_dir: bool) -> bool:
        return any((is_dir or not dir_only) and fnmatch.fnmatchcase(name, pat) for pat, dir_only in plain)
    return ignored


class DirtyPaths:
    def __init__(self, root, ignore_patterns: list[str]):
        self.root = str(root)
        self.ignored = name_filter(ignore_patterns)
        self._inotify = None
        self._start()

    def _start(self):
        """(Re)create every watch; the next drain answers None."""
        self.close()
        self._wds: dict[int, str] = {}  # watch descriptor -> its directory, relative to root ("" = root)
        self._changes: dict[str, bool] | None = None
        self._stale = False
        if INotify is None:
            return
        try:
            self._inotify = INotify()
            self._watch_tree("")
        except OSError:  # out of inotify instances or watches (ENOSPC/EMFILE), or an unreadable directory
            self.close()
        if "" not in self._wds.values():  # the root itself is gone: nothing to vouch for, ever
            self.close()

    def close(self):
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def _watch_tree(self, top: str):
        """Watch `top` and every directory below it. The watch comes before the listing: an entry
        created meanwhile is either listed or reported."""
        stack = [top]
        while stack:
            rel = stack.pop()
            path = os.path.join(self.root, rel)
            try:
                self._wds[self._inotify.add_watch(path, MASK)] = rel
                entries = list(os.scandir(path))
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):  # gone already: its parent reports that
                    continue
                raise
            stack += [os.path.join(rel, e.name) for e in entries
                      if e.is_dir(follow_symlinks=False) and self._tracked(e.name, True)]

    def _tracked(self, name: str, is_dir: bool) -> bool:
        return name != ".git" and not self.ignored(name, is_dir)  # git never stores a path named .git

    def drain(self) -> dict[str, bool] | None:
        """{path: created after the last settle()} for everything changed since the last drain, or None."""
        self._read()
        if self._inotify is None:
            return None
        changes, self._changes = self._changes, {}  # after None, the caller's rescan covers the past
        return changes

    def settle(self):
        """The index was just synced with the workspace: any path changed so far may be in it now,
        even one created since the last drain (git may have staged it, or written it: a rollback)."""
        self._read()
        if self._changes:
            self._changes = dict.fromkeys(self._changes, False)

    def _read(self):
        if self._inotify is None:
            return
        try:
            for event in self._inotify.read(timeout=0):
                self._apply(event)
                if self._stale:
                    break
        except OSError:  # a new directory could not be watched (limit reached): watching is over
            self.close()
            return
        if self._stale:
            self._start()

    def forget(self):
        """What was drained could not be used: the next drain answers None."""
        self._changes = None

    def _apply(self, event):
        mask = event.mask
        if mask & flags.Q_OVERFLOW:  # events were lost; the watches themselves are still right
            self._changes = None
            return
        if mask & flags.IGNORED:  # the watch is gone (its directory was deleted)
            self._wds.pop(event.wd, None)
            return
        rel = self._wds.get(event.wd)
        is_dir = bool(mask & flags.ISDIR)
        if rel is None or (mask & flags.DELETE_SELF and rel):  # a deleted subdirectory: its parent reports it
            return
        if mask & SELF or (is_dir and mask & (flags.MOVED_FROM | flags.MOVED_TO)):
            self._stale = True  # a directory moved: paths recorded for the watches below it are wrong
            return
        if not self._tracked(event.name, is_dir) or (is_dir and not mask & (CREATED | flags.DELETE)):
            return  # ignored, or a directory's own metadata (git keeps none)
        path = os.path.join(rel, event.name)
        if self._changes is not None:
            self._changes.setdefault(path, bool(mask & CREATED))
        if is_dir and mask & flags.CREATE:
            self._watch_tree(path)
