"""Following the running command's live-output file (written by the shell tool) for the task page.

A new command replaces the file (new inode) and a long one restarts it past the shell's cap
(smaller than what was read): both are a `reset`, after which the file is read from the start.
"""

from __future__ import annotations

import codecs
import os

CHUNK = 64 << 10  # bytes read per poll at most (a fast command's output arrives over several polls)


class Tail:
    def __init__(self, path: str, start_tail: int = 64 << 10):
        self.path, self.start_tail = path, start_tail
        self.inode, self.offset = None, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def poll(self) -> tuple[bool, str]:
        """(reset, new text since the last poll). The first poll starts `start_tail` bytes from the end."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False, ""
        reset = False
        if st.st_ino != self.inode or st.st_size < self.offset:
            reset, first = True, self.inode is None
            self.inode = st.st_ino
            self.offset = max(0, st.st_size - self.start_tail) if first else 0
            self.decoder.reset()
        if st.st_size <= self.offset:
            return reset, ""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(min(CHUNK, st.st_size - self.offset))
        except FileNotFoundError:
            return reset, ""
        self.offset += len(data)
        return reset, self.decoder.decode(data)
