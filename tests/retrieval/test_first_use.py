"""`openglm index` on the odd files of a real checkout: pipes, unreadable files, non-UTF-8 names."""

import json
import os
import pathlib
import threading

import pytest

from openglm.cli import main
from openglm.retrieval import code_index
from openglm.retrieval import embedder as embedder_module


@pytest.fixture
def patched_embedder(embedder, monkeypatch):
    factory = lambda model_path=None, max_seq_length=128, **kw: embedder  # noqa: E731
    monkeypatch.setattr(embedder_module, "Embedder", factory)
    monkeypatch.setattr(code_index, "Embedder", factory)
    return embedder


def test_build_skips_a_named_pipe_an_unreadable_file_and_a_non_utf8_name(tmp_path, capsys, monkeypatch,
                                                                         patched_embedder):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "good.py").write_text("def add(a, b):\n    return a + b\n")
    os.mkfifo(repo / "pipe.py")  # opening it for reading would block until a writer comes: forever
    (repo / "secret.py").write_text("x = 1\n")
    (repo / os.fsdecode(b"caf\xe9.py")).write_text("y = 2\n")  # a Latin-1 name on a UTF-8 system
    real_read = pathlib.Path.read_bytes

    def read_bytes(path):
        if path.name == "secret.py":  # (the tests run as root, where chmod 000 does not stop a read)
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    result = {}
    worker = threading.Thread(target=lambda: result.update(rc=main(["index", "build", str(repo),
                                                                    "--max-seq-length", "128", "--json"])),
                              daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "index build hangs"
    assert result["rc"] == 0
    out, err = capsys.readouterr()
    stats = json.loads(out)
    assert stats["added"] == ["good.py"]
    assert "pipe.py: not a regular file" in err and "secret.py: cannot read (Permission denied)" in err
    assert "caf\\xe9.py: file name is not valid UTF-8" in err


def test_search_with_k_below_one_is_a_clear_error(tmp_path, capsys, patched_embedder):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "good.py").write_text("def add(a, b):\n    return a + b\n")
    assert main(["index", "build", str(repo), "--max-seq-length", "128"]) == 0
    with pytest.raises(SystemExit) as exit:
        main(["index", "search", str(repo), "add", "-k", "-1"])
    assert exit.value.code == 2 and "must be at least 1, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="k must be a whole number >= 1"):
        code_index.CodeIndex.open(repo).search("add", -1)
