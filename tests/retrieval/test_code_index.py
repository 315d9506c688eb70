"""The code knowledge base on a small repository made of real standard-library files."""

import json
import json.decoder
import shutil
import textwrap
from pathlib import Path

import pytest

from openglm.retrieval import code_index as ci
from openglm.retrieval.chunking import chunk_file
from openglm.retrieval.code_index import CodeIndex
from openglm.retrieval.embedder import Embedder

JSON_DIR = Path(json.decoder.__file__).parent


class CountingEmbedder:
    """The real embedder, recording how many texts it was asked to embed."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.identity, self.model_path = inner.identity, inner.model_path

    def encode(self, texts, progress=False):
        self.calls.append(len(texts))
        return self.inner.encode(texts)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "json").mkdir(parents=True)
    for name in ("decoder.py", "scanner.py"):
        shutil.copy(JSON_DIR / name, root / "json" / name)
    shutil.copy(textwrap.__file__, root / "textwrap.py")
    (root / "README.md").write_text("# demo\n\nA copy of a few standard library modules.\n")
    return root


def test_build_search_and_reopen(repo, embedder):
    counting = CountingEmbedder(embedder)
    index, stats = CodeIndex.build(repo, embedder=counting)
    expected = sum(len(chunk_file(p.relative_to(repo).as_posix(), p.read_text()))
                   for p in repo.rglob("*") if p.is_file() and ".openglm-index" not in p.parts)
    assert sorted(stats.added) == ["README.md", "json/decoder.py", "json/scanner.py", "textwrap.py"]
    assert stats.total_chunks == stats.chunks_embedded == expected == sum(counting.calls)
    # Lexical: an identifier finds its definition, with the right span.
    top = index.search("_wrap_chunks", k=3, mode="bm25")[0]
    assert (top.path, top.name) == ("textwrap.py", "TextWrapper._wrap_chunks")
    source = (repo / "textwrap.py").read_text().splitlines()
    assert source[top.start_line - 1].strip().startswith("def _wrap_chunks")
    # Dense and hybrid: natural language finds the right module.
    dense = index.search("split a paragraph into lines of limited width", k=5, mode="dense")
    assert "textwrap.py" in [h.path for h in dense]
    hybrid = index.search("decode a JSON string literal with escape sequences", k=5)
    assert hybrid[0].path.startswith("json/") and len(hybrid) == 5
    # Re-open from disk (another process would): same results, model loaded from the manifest.
    reopened = CodeIndex.open(repo, embedder=embedder)
    assert [h.location for h in reopened.search("_wrap_chunks", 3, "bm25")] == \
        [h.location for h in index.search("_wrap_chunks", 3, "bm25")]
    assert [h.location for h in reopened.search("JSON decoder errors", 5, "dense")] == \
        [h.location for h in index.search("JSON decoder errors", 5, "dense")]


def test_incremental_rebuild_touches_only_changed_files(repo, embedder):
    index, _ = CodeIndex.build(repo, embedder=embedder)
    ids_before = {rel: f["chunk_ids"] for rel, f in index.manifest["files"].items()}
    with open(repo / "json" / "scanner.py", "a") as f:
        f.write("\n\ndef brand_new_tokenizer_helper(stream):\n    \"\"\"Count unicode surrogates.\"\"\"\n"
                "    return sum(1 for ch in stream if 0xD800 <= ord(ch) <= 0xDFFF)\n")
    (repo / "README.md").unlink()
    (repo / "NOTES.txt").write_text("release notes\n")
    counting = CountingEmbedder(embedder)
    index, stats = CodeIndex.build(repo, embedder=counting)
    assert (stats.added, stats.changed, stats.removed, stats.unchanged) == \
        (["NOTES.txt"], ["json/scanner.py"], ["README.md"], 2)
    scanner_text = (repo / "json" / "scanner.py").read_text()
    assert sum(counting.calls) == stats.chunks_embedded == len(chunk_file("json/scanner.py", scanner_text)) + 1
    for rel in ("json/decoder.py", "textwrap.py"):  # untouched: same chunk ids
        assert index.manifest["files"][rel]["chunk_ids"] == ids_before[rel]
    assert index.search("brand_new_tokenizer_helper", 1, "bm25")[0].name == "brand_new_tokenizer_helper"
    assert all(h.path != "README.md" for h in index.search("standard library modules demo", 20, "hybrid"))
    # Nothing changed: nothing is embedded.
    counting.calls.clear()
    _, stats = CodeIndex.build(repo, embedder=counting)
    assert counting.calls == [] and stats.unchanged == 4 and stats.chunks_embedded == 0


def test_growing_past_exact_search_switches_to_the_ladder(repo, embedder, monkeypatch):
    monkeypatch.setattr(ci, "EXACT_UP_TO", 20)
    index, stats = CodeIndex.build(repo, embedder=embedder)
    assert stats.total_chunks > 20 and index.vectors.config.nlist > 0 and index.vectors.config.rerank
    index.vectors.set_search(nprobe=index.vectors.config.nlist, prune_ratio=1e9)
    hit = index.search("split a paragraph into lines of limited width", 3, "dense")
    exact = CodeIndex.open(repo, embedder=embedder)
    exact.vectors.set_search(nprobe=exact.vectors.config.nlist, prune_ratio=1e9, rerank=1000)
    assert [h.location for h in hit] == [h.location for h in exact.search(
        "split a paragraph into lines of limited width", 3, "dense")]


def test_bad_inputs_give_clear_errors(repo, tmp_path, embedder):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CodeIndex.build(tmp_path / "nope", embedder=embedder)
    empty = tmp_path / "empty"
    (empty / ".git").mkdir(parents=True)
    (empty / "logo.png").write_bytes(b"\x89PNG\0\0")
    with pytest.raises(ValueError, match="no indexable text files"):
        CodeIndex.build(empty, embedder=embedder)
    with pytest.raises(FileNotFoundError, match="no code index"):
        CodeIndex.open(repo)
    CodeIndex.build(repo, embedder=embedder)
    other = Embedder(max_seq_length=64)  # same weights, different identity
    with pytest.raises(ValueError, match="was built with embedder"):
        CodeIndex.open(repo, embedder=other)
    with pytest.raises(ValueError, match="was built with embedder"):
        CodeIndex.build(repo, embedder=other)
    index = CodeIndex.open(repo, embedder=embedder)
    with pytest.raises(ValueError, match="unknown search mode"):
        index.search("x", mode="fuzzy")


def fake_index(names: list[str]) -> CodeIndex:
    """An index of chunks named `names` (ids 0..n-1), no vectors: the rankings are given by the test."""
    chunks = {i: ci.Chunk(path=f"m{i}.py", start_line=1, end_line=2, kind="function", name=n, text="")
              for i, n in enumerate(names)}
    return CodeIndex(Path("idx"), Path("repo"), {}, chunks, None, None)


def test_one_shared_word_does_not_outrank_what_the_question_means(monkeypatch):
    """A question in words: the dense ranking's clear first stays first over a chunk that only shares a word
    with it ("detect circular references" vs `detect_encoding`, 17th by meaning, 1st by words)."""
    names = ["find_reference_cycles", *[f"other_{i}" for i in range(15)], "detect_encoding"]
    index = fake_index(names)
    monkeypatch.setattr(index, "_dense", lambda q, k: [(i, 0.5 - 0.01 * i) for i in range(len(names))][:k])
    monkeypatch.setattr(index, "_lexical", lambda q, k: [(16, 6.9), (14, 1.2)][:k])
    assert index.search("detect circular references", 3)[0].name == "find_reference_cycles"


def test_an_identifier_query_keeps_the_lexical_first(monkeypatch):
    """Code in the query (a name, a traceback): BM25's exact match leads, as it did before."""
    names = ["TextWrapper.wrap", "fill", "dedent", "indent", "shorten", "TextWrapper._wrap_chunks"]
    index = fake_index(names)
    monkeypatch.setattr(index, "_dense", lambda q, k: [(i, 0.5 - 0.01 * i) for i in range(len(names))][:k])
    monkeypatch.setattr(index, "_lexical", lambda q, k: [(5, 9.0), (0, 2.0)][:k])
    assert index.search("TextWrapper._wrap_chunks", 3)[0].name == "TextWrapper._wrap_chunks"
    assert index.search("TextWrapper._wrap_chunks(self, chunks) raises IndexError", 3)[0].name == \
        "TextWrapper._wrap_chunks"


def test_fusion_weights_move_from_words_to_code():
    assert ci.fusion_weights("parse a JSON number") == pytest.approx(ci.FUSION_NATURAL)
    assert ci.fusion_weights("json.decoder.py_scanstring(s, end)") == pytest.approx(ci.FUSION_CODE)
    dense, bm25 = ci.fusion_weights("why does py_scanstring fail on escapes")  # one code word in six
    assert ci.FUSION_CODE[0] < dense < ci.FUSION_NATURAL[0] and ci.FUSION_NATURAL[1] < bm25 < ci.FUSION_CODE[1]
