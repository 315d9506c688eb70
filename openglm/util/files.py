"""Atomic file and folder replacement: readers never see a half-written file, and a crash at any
moment leaves the previous version in place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[Path], None], *, fsync: bool = False,
                 keep_mode: bool = False) -> None:
    """Write `data` (text, bytes, or a function `write(tmp_path)`) to a temp file beside `path` and
    rename it over `path`. The temp name keeps the suffix (np.save and savefig go by it). `fsync`:
    flush to disk before the rename (a pointer that must survive a power cut); `keep_mode`: keep the
    permission bits of the file replaced (an edited script stays executable)."""
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
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename folder `src` to `dst`, replacing an existing `dst` with no window where neither exists
    under a usable name (the old one is moved aside first, then deleted)."""
    src, dst = Path(src), Path(dst)
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{dst.name}-", dir=dst.parent))  # train/checkpoint prunes .old-*
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
