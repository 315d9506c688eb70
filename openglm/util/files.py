"""Atomic file and folder replacement: readers never see a half-written file, and a crash at any
moment leaves the previous version in place. What they publish gets the modes a plain `open`/`mkdir` would give
(0644 / 0755 under the usual umask), not the private modes of the temp files they are written as: a checkpoint
or an index is read by other users (a container's UID, a serving engine)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process's umask, read without changing it (os.umask can only be read by setting it, which races
    with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def default_mode(is_dir: bool = False) -> int:
    """The mode `open(..., "w")` (0666) or `mkdir` (0777) gives under the current umask."""
    return (0o777 if is_dir else 0o666) & ~umask()


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[Path], None], *, fsync: bool = False,
                 keep_mode: bool = False, mode: int | None = None) -> None:
    """Write `data` (text, bytes, or a function `write(tmp_path)`) to a temp file beside `path` and
    rename it over `path`. The temp name keeps the suffix (np.save and savefig go by it). `fsync`:
    flush to disk before the rename (a pointer that must survive a power cut); `keep_mode`: keep the
    permission bits of the file replaced (an edited script stays executable); `mode`: the file's mode (a
    secret: 0o600); else the umask's default, as a plain `open` would create it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    try:
        if callable(data):
            os.close(fd)
            data(Path(tmp))
        else:
            with os.fdopen(fd, "w" if isinstance(data, str) else "wb",
                           **({"encoding": "utf-8"} if isinstance(data, str) else {})) as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        if keep_mode and path.exists():
            shutil.copymode(path, tmp)
        else:
            os.chmod(tmp, default_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename folder `src` to `dst`, replacing an existing `dst` with no window where neither exists
    under a usable name (the old one is moved aside first, then deleted). `src` (often a private `mkdtemp`
    folder) gets the umask's folder mode first."""
    src, dst = Path(src), Path(dst)
    os.chmod(src, default_mode(is_dir=True))
    restore_replaced_dir(dst)
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{dst.name}-", dir=dst.parent))  # train/checkpoint prunes .old-*
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def restore_replaced_dir(dst: str | os.PathLike) -> bool:
    """Undo a `replace_dir` killed between its two renames (nothing at `dst`, the previous copy in
    `.old-NAME-*/NAME`): put the previous copy back. Readers and the next writer call this first."""
    dst = Path(dst)
    if dst.exists() or not dst.parent.is_dir():
        return False
    for old in sorted(dst.parent.glob(f".old-{dst.name}-*")):
        if (old / dst.name).is_dir():
            os.replace(old / dst.name, dst)
            shutil.rmtree(old, ignore_errors=True)
            return True
    return False
