"""A warm search server for one index, and its client: `openglm index serve PATH` keeps the embedder (and the
BM25 and vector indexes) loaded and answers `openglm index search` over a Unix socket, so a search costs a
round trip instead of importing sentence-transformers and torch (seconds) every time.

The socket lives in the user's private runtime folder ($XDG_RUNTIME_DIR, else TMPDIR/openglm-UID, mode 0700),
named by a hash of the index folder; only its owner can connect. One JSON line each way:

    request:  {"query": "parse a JSON number", "k": 10, "mode": "hybrid"}
    response: {"hits": [{"path": ..., "start_line": ..., "name": ..., "score": ..., ...}]}  or  {"error": "..."}

Requests are bounded (MAX_REQUEST_BYTES, k <= MAX_K, READ_TIMEOUT_S to send one) and served one at a time;
the index is reopened when `openglm index build` rewrites it; the server exits after `idle_timeout` seconds
without a request and removes its socket. This module imports nothing heavy: a search that finds no server
loads the index itself (code_index.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from pathlib import Path

INDEX_DIRNAME = ".openglm-index"
MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 256 * 1024 * 1024
MAX_K = 1000
READ_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 1800.0


def index_dir_of(path: str | Path) -> Path:
    """The index folder of `path`: an index folder itself, or a repository's default index."""
    path = Path(path)
    index_dir = path if (path / "manifest.json").exists() else path / INDEX_DIRNAME
    if not (index_dir / "manifest.json").exists():
        raise FileNotFoundError(f"no code index at {path} (looked for {index_dir / 'manifest.json'}); "
                                f"build one with `openglm index build {path}`")
    return index_dir


def _runtime_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime)
    return Path(tempfile.gettempdir()) / f"openglm-{os.getuid()}"


def _check_private(folder: Path) -> None:
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{folder} is not a private folder of this user (mode {stat.filemode(st.st_mode)}): "
                      "refusing to use a search socket there")


def socket_path(index_dir: Path, create: bool = False) -> Path:
    """The socket of `index_dir`'s server, in the user's private runtime folder (made 0700 with `create`)."""
    folder = _runtime_dir()
    if create:
        folder.mkdir(mode=0o700, exist_ok=True)
    _check_private(folder)
    key = hashlib.sha256(str(Path(index_dir).resolve()).encode()).hexdigest()[:16]
    return folder / f"openglm-index-{key}.sock"


def _read_line(conn: socket.socket, limit: int) -> bytes:
    """One newline-terminated message, at most `limit` bytes (ValueError past it)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError(f"message longer than {limit} bytes")
    return bytes(data)


# ---- client -------------------------------------------------------------------------------------------
def search_warm(index_dir: Path, query: str, k: int, mode: str, timeout: float = 120.0) -> list[dict] | None:
    """The hits of a warm server for `index_dir` (Hit.to_dict() rows), or None when none is running.
    A request the server refuses (an empty query, a bad k) raises ValueError with its reason."""
    try:
        path = socket_path(index_dir)
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():  # only ever talk to our own server
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(str(path))
            conn.sendall(json.dumps({"query": query, "k": k, "mode": mode}).encode() + b"\n")
            reply = json.loads(_read_line(conn, MAX_RESPONSE_BYTES) or b"null")
        except (OSError, ValueError):  # a stale socket, a server that stopped mid-answer: search without it
            return None
    if not isinstance(reply, dict):
        return None
    if "error" in reply:
        raise ValueError(str(reply["error"]))
    return reply.get("hits")


# ---- server -------------------------------------------------------------------------------------------
class WarmServer:
    """Serves searches of one index from a loaded CodeIndex until idle for `idle_timeout` seconds (0: never)."""

    def __init__(self, path: str | Path, embedder=None, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S):
        from .code_index import CodeIndex  # FAISS + torch: the server exists to hold them loaded

        self.index_dir = index_dir_of(path)
        self._open = lambda emb: CodeIndex.open(self.index_dir, embedder=emb)
        self.index = self._open(embedder)
        self.index.search("warm up", 1)  # loads the embedder and builds the BM25 index now, not on a request
        self._stamp = self._manifest_stamp()
        self.idle_timeout = idle_timeout
        self.path = socket_path(self.index_dir, create=True)
        self.sock = self._bind()
        self.stopped = False

    def _manifest_stamp(self) -> int:
        return os.stat(self.index_dir / "manifest.json").st_mtime_ns

    def _bind(self) -> socket.socket:
        if self.path.exists():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(str(self.path))
                except OSError:
                    self.path.unlink()  # left by a server that was killed
                else:
                    raise OSError(f"{self.index_dir} is already served (socket {self.path})")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: only this user can connect
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(8)
        sock.settimeout(0.5)
        return sock

    def serve(self) -> None:
        last = time.monotonic()
        try:
            while not self.stopped:
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    if self.idle_timeout and time.monotonic() - last > self.idle_timeout:
                        return
                    continue
                with conn:
                    self._answer(conn)
                last = time.monotonic()
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                self.path.unlink()
        except OSError:
            pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        try:
            reply = {"hits": self._search(json.loads(_read_line(conn, MAX_REQUEST_BYTES)))}
        except (ValueError, FileNotFoundError, KeyError) as e:  # a bad request, or an index rebuilt badly
            reply = {"error": " ".join(str(e).split())}
        except OSError:
            return  # the client went away or never sent its line
        except Exception as e:  # noqa: BLE001 - a bug answers one request with an error, not the server's end
            traceback.print_exc(file=sys.stderr)
            reply = {"error": f"internal error in the search server: {type(e).__name__}: {e}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass

    def _search(self, req) -> list[dict]:
        if not isinstance(req, dict) or not isinstance(req.get("query"), str):
            raise ValueError('request must be a JSON object with a "query" string')
        k, mode = req.get("k", 10), req.get("mode", "hybrid")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be a whole number from 1 to {MAX_K}, got {k!r}")
        stamp = self._manifest_stamp()
        if stamp != self._stamp:  # `openglm index build` rewrote the index: reopen it, keep the embedder
            self.index = self._open(self.index.embedder)
            self._stamp = stamp
        return [h.to_dict() for h in self.index.search(req["query"], k, mode=str(mode))]


def serve_index(path: str | Path, idle_timeout: float) -> int:
    """`openglm index serve`: run a WarmServer in the foreground until idle, SIGTERM or Ctrl-C."""
    server = WarmServer(path, idle_timeout=idle_timeout)

    def stop(signum, frame):
        server.stopped = True

    signal.signal(signal.SIGTERM, stop)
    idle = f"exits after {idle_timeout:g} s without a search" if idle_timeout else "runs until stopped"
    print(f"openglm index serve: {server.index_dir} ({len(server.index.chunks)} chunks) warm on {server.path}; "
          f"`openglm index search` uses it; {idle}, Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    return 0
