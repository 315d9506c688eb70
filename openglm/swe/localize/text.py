"""Text similarity between the issue statement and the code: BM25 over functions, whose
identifiers are split (camelCase, snake_case) so `parse_version` in the issue meets `parseVersion`.
Line scores inside a function count the query words each line shares."""

from __future__ import annotations

import re

from openglm.retrieval.lexical import bm25_model
from openglm.retrieval.spans import FunctionIndex, is_test_path
from openglm.swe.localize.sbfl import function_key

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_CAMEL = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
STOP = set("""a an and are as at be by for from has have in is it its of on or that the this to was
were will with not no but if else def self return none true false import class assert test tests
expected got error line file py""".split())


def tokens(text: str) -> list[str]:
    out = []
    for word in _WORD.findall(text):
        parts = [p.lower() for piece in word.split("_") for p in _CAMEL.findall(piece)]
        for t in [word.lower(), *parts] if len(parts) > 1 else parts:
            if len(t) > 1 and t not in STOP:
                out.append(t)
    return out


def bm25(query: list[str], docs: dict[str, list[str]], k1: float = 1.2, b: float = 0.75
         ) -> dict[str, float]:
    """BM25 score of each document sharing a token with the query (the retrieval package's BM25)."""
    if not docs or not query:
        return {}
    keys = list(docs)
    scores = bm25_model([docs[k] for k in keys], k1=k1, b=b).get_scores(query)
    return {k: float(s) for k, s in zip(keys, scores) if s > 0}


def text_scores(index: FunctionIndex, issue: str, top_functions: int = 20) -> dict[str, dict[str, float]]:
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    query = tokens(issue)
    if not query:
        return scores
    docs, spans = {}, {}
    for rel, fns in index.functions.items():
        if is_test_path(rel):
            continue
        lines = index.sources[rel].splitlines()
        for f in fns:
            # The name counts twice: it is the most telling part of a function's text.
            docs[f.key] = tokens(f.name) * 2 + tokens("\n".join(lines[f.start_line - 1:f.end_line]))
            spans[f.key] = (rel, f.start_line, lines[f.start_line - 1:f.end_line])
    scores["functions"] = bm25(query, docs)
    for key, s in scores["functions"].items():
        rel = spans[key][0]
        scores["files"][rel] = max(scores["files"].get(rel, 0.0), s)
    qset = set(query)
    best = sorted(scores["functions"], key=scores["functions"].get, reverse=True)[:top_functions]
    for key in best:
        rel, start, body = spans[key]
        for i, text in enumerate(body):
            shared = len(qset.intersection(tokens(text)))
            if shared:
                scores["lines"][f"{rel}:{start + i}"] = shared * scores["functions"][key]
    return scores


def test_source(index: FunctionIndex, nodeid: str) -> str:
    """The source of a test function named by a pytest node id (`tests/x.py::TestX::test_y[1]`)."""
    rel, _, rest = nodeid.partition("::")
    name = rest.split("[", 1)[0].replace("::", ".")
    lines = index.sources.get(rel, "").splitlines()
    for fn in index.functions.get(rel, []):
        if name and (fn.name == name or fn.name.endswith("." + name.rsplit(".", 1)[-1])):
            return "\n".join(lines[fn.start_line - 1:fn.end_line])
    return ""


def test_text_scores(index: FunctionIndex, failing: list[str], counts: dict[str, dict[int, list[int]]],
                     failure_texts: list[str]) -> dict[str, dict[str, float]]:
    """BM25 between what the failing tests say (their names, code and failure messages) and the
    functions they executed: `test_js_to_json_realworld` meets `js_to_json`."""
    query = []
    for test in failing:
        query += tokens(test.split("::", 1)[-1]) * 2 + tokens(test_source(index, test))
    for text in failure_texts:
        query += tokens("\n".join(ln for ln in text.splitlines() if ln.startswith("E ")))
    scores: dict[str, dict[str, float]] = {"files": {}, "functions": {}, "lines": {}}
    executed = {function_key(index, rel, line) for rel, lines in counts.items()
                for line, (ef, *_) in lines.items() if ef}
    docs = {}
    for rel, fns in index.functions.items():
        lines = index.sources[rel].splitlines()
        for f in fns:
            if f.key in executed:
                docs[f.key] = tokens(f.name) * 2 + tokens("\n".join(lines[f.start_line - 1:f.end_line]))
    scores["functions"] = bm25(query, docs)
    for key, s in scores["functions"].items():
        rel = key.split("::", 1)[0]
        scores["files"][rel] = max(scores["files"].get(rel, 0.0), s)
    return scores
