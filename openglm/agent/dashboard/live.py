"""Following the running command's live-output file (`tools.shell.LiveOutput`) for the task page.

The file's first line, `[<start>] $ <command>`, is new for every command (the shell reuses the
path, and a reused inode or a longer new file could not be told apart otherwise); a different
first line, or a file shorter than what was read (the shell's cap restarted it), is a `reset`.
"""

from __future__ import annotations

import codecs
import os
import re

CHUNK = 256 << 10  # bytes read per poll at most (a fast command's output arrives over several polls)
_HEADER = re.compile(rb"^\[(\d+(?:\.\d+)?)\] \$ (.*)$")


class Tail:
    def __init__(self, path: str, start_tail: int = 64 << 10):
        self.path, self.start_tail = path, start_tail
        self.header: bytes | None = None
        self.offset = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def poll(self) -> tuple[dict | None, str]:
        """(the command's header if a new output started, else None; new text since the last poll).
        The first poll of a long output starts `start_tail` bytes from its end."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = f.readline(4096)
                if not header.endswith(b"\n"):
                    return None, ""  # not even the first line yet
                started = None
                if header != self.header or size < self.offset:
                    started = _parse(header)
                    first = self.header is None
                    self.header, self.offset = header, len(header)
                    if first:
                        self.offset = max(len(header), size - self.start_tail)
                    self.decoder.reset()
                f.seek(self.offset)
                data = f.read(min(CHUNK, max(0, size - self.offset)))
        except FileNotFoundError:
            return None, ""
        self.offset += len(data)
        return started, self.decoder.decode(data)


def _parse(header: bytes) -> dict:
    m = _HEADER.match(header.rstrip(b"\n"))
    if not m:
        return {"command": header.decode("utf-8", "replace").rstrip("\n"), "started": None}
    return {"command": m.group(2).decode("utf-8", "replace"), "started": float(m.group(1))}
