"""Identifier-aware tokenisation, two-field BM25 and reciprocal rank fusion."""

from openglm.retrieval.lexical import BM25Index, reciprocal_rank_fusion, tokenize


def test_identifiers_are_split_the_way_people_search():
    assert tokenize("TextWrapper._wrap_chunks(HTTPServer)") == [
        "textwrapper", "text", "wrapper", "_wrap_chunks", "wrap", "chunks", "httpserver", "http", "server"]
    assert tokenize("x = 1") == []  # one-letter names carry no signal


def test_name_field_puts_the_definition_above_its_callers():
    texts = ["def helper(a):\n    return a + 1",
             "def caller(x):\n    y = helper(x)\n    return helper(y)",
             "def other(): pass"]
    names = ["m.py helper", "m.py caller", "m.py other"]
    _, plain = BM25Index(texts, names, name_weight=0).search("helper", 3)
    _, named = BM25Index(texts, names).search("helper", 3)
    assert list(plain) == [1, 0]  # the caller mentions `helper` twice and wins on text alone
    assert list(named) == [0, 1]  # the name field fixes that; `other` never matches
    assert len(BM25Index(texts, names).search("nothing matches", 3)[1]) == 0


def test_reciprocal_rank_fusion_rewards_agreement():
    fused = reciprocal_rank_fusion([[1, 2, 3], [4, 2, 5]], k=3)
    assert [i for i, _ in fused] == [2, 1, 4]  # second in both lists beats first in one (ties: by id)
    assert abs(fused[0][1] - 2 / 62) < 1e-12 and abs(fused[1][1] - 1 / 61) < 1e-12


def test_weighted_fusion_lets_the_stronger_ranking_lead():
    dense, lexical = [7, 8, 9], [9, 8, 7]
    assert [i for i, _ in reciprocal_rank_fusion([dense, lexical], k=3)] == [7, 9, 8]  # unweighted: 7 and 9 tie (by id)
    fused = reciprocal_rank_fusion([dense, lexical], k=3, weights=[0.5, 1.0])
    assert [i for i, _ in fused] == [9, 8, 7]
    assert abs(fused[0][1] - (0.5 / 63 + 1 / 61)) < 1e-12


def test_fusion_rejects_bad_weights():
    import pytest

    with pytest.raises(ValueError, match="one non-negative weight per ranking"):
        reciprocal_rank_fusion([[1], [2]], k=1, weights=[1.0])
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([[1], [2]], k=1, weights=[1.0, -1.0])


def test_code_share_tells_a_question_from_code():
    from openglm.retrieval.lexical import code_share

    assert code_share("detect circular references") == 0.0
    assert code_share("where are retries handled") == 0.0
    assert code_share("_wrap_chunks") == code_share("TextWrapper._wrap_chunks") == 1.0
    report = ("FAILED tests/test_cache.py::test_lru - AssertionError: assert 3 == 2\n"
              "E   where 3 = len(LRUCache({1: 1}, maxsize=2))\nsrc/cachetools/__init__.py:123: in __setitem__")
    assert code_share(report) >= 0.5
    assert 0 < code_share("KeyError in json.decoder.raw_decode") < 1
