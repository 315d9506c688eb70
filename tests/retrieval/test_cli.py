"""`openglm index build|search` end to end (in-process, the session's embedder)."""

import json
import shutil
import textwrap

import pytest

from openglm.cli import main
from openglm.retrieval import code_index
from openglm.retrieval import embedder as embedder_module


@pytest.fixture
def patched_embedder(embedder, monkeypatch):
    def factory(model_path=None, max_seq_length=128, **kw):
        assert max_seq_length == embedder.identity.max_seq_length
        return embedder
    monkeypatch.setattr(embedder_module, "Embedder", factory)
    monkeypatch.setattr(code_index, "Embedder", factory)
    return embedder


def test_build_then_search_table_and_json(tmp_path, capsys, patched_embedder):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(textwrap.__file__, repo / "textwrap.py")
    assert main(["index", "build", str(repo), "--max-seq-length", "128", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["added"] == ["textwrap.py"] and stats["chunks_embedded"] == stats["total_chunks"] > 10

    assert main(["index", "search", str(repo), "fix sentence endings", "-k", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["rank", "score", "location", "name"]
    assert "TextWrapper._fix_sentence_endings" in table[1] and "textwrap.py:" in table[1]

    assert main(["index", "search", str(repo / ".openglm-index"), "_wrap_chunks", "--mode", "bm25",
                 "--json", "-k", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["name"] == "TextWrapper._wrap_chunks"
    assert rows[0]["location"] == f"textwrap.py:{rows[0]['start_line']}-{rows[0]['end_line']}"


def test_cli_errors_are_one_line_messages(tmp_path, capsys, patched_embedder):
    assert main(["index", "build", str(tmp_path / "missing"), "--max-seq-length", "128"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["index", "search", str(tmp_path), "anything"]) == 1
    assert "no code index" in capsys.readouterr().err
