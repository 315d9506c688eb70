"""`openglm index serve`: a warm server answers `openglm index search` over a private Unix socket with the
same hits as a cold search, follows a rebuilt index, refuses bad requests, and leaves when idle."""

import json
import os
import shutil
import socket
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from openglm.cli import main
from openglm.retrieval import code_index, warm
from openglm.retrieval.code_index import CodeIndex, search_repository
from openglm.retrieval.embedder import Embedder


@pytest.fixture
def runtime(monkeypatch):
    """A short private runtime folder (a Unix socket path must stay under ~107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="ogw"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def repo(tmp_path, embedder):
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(textwrap.__file__, root / "textwrap.py")
    CodeIndex.build(root, embedder=embedder)
    return root


@pytest.fixture
def server(repo, embedder, runtime):
    srv = warm.WarmServer(repo, embedder=embedder, idle_timeout=0)
    thread = threading.Thread(target=srv.serve, daemon=True)
    thread.start()
    yield srv
    srv.stopped = True
    thread.join(timeout=10)
    assert not thread.is_alive()


def ask(srv, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(srv.path))
        conn.sendall(payload)
        return json.loads(warm._read_line(conn, warm.MAX_RESPONSE_BYTES))


def test_a_warm_search_equals_a_cold_one(repo, server, embedder):
    index_dir = repo / ".openglm-index"
    for mode in ("hybrid", "dense", "bm25"):
        cold = CodeIndex.open(repo, embedder=embedder).search("fix sentence endings", 5, mode=mode)
        hot = warm.search_warm(index_dir, "fix sentence endings", 5, mode)
        assert [(h["location"], h["name"]) for h in hot] == [(h.location, h.name) for h in cold]
        assert [h["score"] for h in hot] == pytest.approx([h.score for h in cold], abs=1e-5)
    assert oct(os.stat(server.path).st_mode & 0o777) == "0o600"  # only its owner can connect


def test_the_cli_and_the_agent_search_use_the_server_without_loading_a_model(repo, server, capsys, monkeypatch):
    def cold(*args, **kwargs):
        raise AssertionError("a warm search must not open the index itself")

    monkeypatch.setattr(code_index.CodeIndex, "open", cold)
    assert main(["index", "search", str(repo), "fix sentence endings", "-k", "3"]) == 0
    out = capsys.readouterr()
    assert "TextWrapper._fix_sentence_endings" in out.out.splitlines()[1] and out.err == ""
    hits, how = search_repository(repo, "_wrap_chunks", 2, mode="bm25")
    assert how == "bm25" and hits[0].name == "TextWrapper._wrap_chunks" and hits[0].location.startswith("textwrap.py:")


def test_a_rebuilt_index_is_reopened(repo, server, embedder):
    (repo / "extra.py").write_text("def reticulate_splines(n):\n    return [n] * 3\n")
    CodeIndex.build(repo, embedder=embedder)
    hits = warm.search_warm(repo / ".openglm-index", "reticulate_splines", 1, "bm25")
    assert hits[0]["name"] == "reticulate_splines"


def test_bad_requests_get_one_line_errors_and_the_server_keeps_serving(repo, server):
    assert ask(server, b"not json\n")["error"].startswith("Expecting value")
    assert "query" in ask(server, b'{"k": 3}\n')["error"]
    assert "longer than" in ask(server, b"x" * (warm.MAX_REQUEST_BYTES + 10))["error"]
    with pytest.raises(ValueError, match="k must be a whole number from 1 to 1000"):
        warm.search_warm(repo / ".openglm-index", "wrap", 5000, "hybrid")
    with pytest.raises(ValueError, match="empty query"):
        warm.search_warm(repo / ".openglm-index", "  ", 3, "hybrid")
    with pytest.raises(ValueError, match="unknown search mode"):
        warm.search_warm(repo / ".openglm-index", "wrap", 3, "fuzzy")
    assert warm.search_warm(repo / ".openglm-index", "wrap", 1, "bm25")  # still answering


def test_no_server_or_a_stale_socket_means_a_cold_search(repo, embedder, runtime):
    index_dir = repo / ".openglm-index"
    assert warm.search_warm(index_dir, "wrap", 3, "bm25") is None
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(warm.socket_path(index_dir)))  # bound, never listening: what a killed server leaves
    stale.close()
    assert warm.search_warm(index_dir, "wrap", 3, "bm25") is None
    srv = warm.WarmServer(repo, embedder=embedder, idle_timeout=0.5)  # replaces the stale socket
    srv.serve()  # returns after half a second without a search
    assert not srv.path.exists()


def test_one_server_per_index(repo, server, embedder):
    with pytest.raises(OSError, match="already served"):
        warm.WarmServer(repo, embedder=embedder)


def test_a_shared_runtime_folder_is_refused(repo, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    with pytest.raises(OSError, match="not a private folder"):
        warm.socket_path(repo / ".openglm-index")
    assert warm.search_warm(repo / ".openglm-index", "wrap", 3, "bm25") is None


def test_loading_the_embedder_draws_no_progress_bar(capfd):
    Embedder(max_seq_length=128)
    assert "Loading weights" not in capfd.readouterr().err
