"""Lexical search (BM25 via `bm25s`) over identifiers and text, and rank fusion with dense hits.

Code identifiers are split the way people search for them: `TextWrapper._wrap_chunks` yields
`textwrapper`, `text`, `wrapper`, `_wrap_chunks`, `wrap`, `chunks`, so a query "wrap chunks" and a
query "_wrap_chunks" both match.
"""

from __future__ import annotations

import re

import numpy as np

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# A query word that is code: snake_case, camelCase, a dotted or path name, a call, an operator, file:line.
_CODE_WORD = re.compile(r"\w_|_\w|[a-z][A-Z]|[A-Z]{2,}[a-z]|\w\.\w|[()\[\]{}=<>/\\]|::|:\d|^[#@$]")
_LETTER = re.compile(r"[A-Za-z]")


def tokenize(text: str) -> list[str]:
    tokens = []
    for ident in _IDENT.findall(text):
        low = ident.lower()
        parts = [p.lower() for p in _PART.findall(ident)]
        if len(low) > 1 and parts != [low]:
            tokens.append(low)  # the whole identifier, for exact-name queries
        tokens += [p for p in parts if len(p) > 1]
    for number in re.findall(r"\b\d{2,}\b", text):
        tokens.append(number)
    return tokens


def code_share(query: str) -> float:
    """The share of a query's words that are code (identifiers, paths, calls): 0 for a plain question, near 1
    for a traceback or a name. Words without a letter (numbers, markers) do not count either way."""
    words = [w for w in query.split() if _LETTER.search(w)]
    if not words:
        return 1.0
    return sum(bool(_CODE_WORD.search(w)) for w in words) / len(words)


class BM25Index:
    """BM25 over two fields, the code text and the definition's name (and path), summed with
    `name_weight` on the name field: a chunk that *is* `_wrap_chunks` outranks the ones that
    merely call it, however long its body."""

    def __init__(self, texts: list[str], names: list[str] | None = None, name_weight: float = 2.0):
        self.size = len(texts)
        self.name_weight = name_weight
        self.text_model = _bm25(texts)
        self.name_model = _bm25(names) if names is not None and name_weight else None

    def search(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, row numbers), best first; only documents sharing a token with the query."""
        tokens = tokenize(query)
        if not tokens or self.size == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        scores = np.asarray(self.text_model.get_scores(tokens), dtype=np.float32)
        if self.name_model is not None:
            scores += self.name_weight * np.asarray(self.name_model.get_scores(tokens), dtype=np.float32)
        k = min(k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        top = top[scores[top] > 0]
        return scores[top], top.astype(np.int64)


def _bm25(documents: list[str]):
    return bm25_model([tokenize(d) for d in documents])


def bm25_model(token_lists: list[list[str]], k1: float = 1.5, b: float = 0.75):
    """The one BM25 (`bm25s`, Lucene's formula) over tokenized documents; `.get_scores(query_tokens)`."""
    import bm25s  # scipy underneath: loaded when a lexical index is first built

    model = bm25s.BM25(k1=k1, b=b)
    # An empty document would break the index; a placeholder token keeps row numbers aligned.
    model.index([tokens or ["\0empty"] for tokens in token_lists], show_progress=False)
    return model


def reciprocal_rank_fusion(rankings: list[list[int]], k: int, c: float = 60.0,
                           weights: list[float] | tuple[float, ...] | None = None) -> list[tuple[int, float]]:
    """Fuse ranked id lists: score(id) = sum over lists of w / (c + rank). Robust to the very
    different score scales of BM25 and cosine similarity (Cormack et al., 2009); `weights`
    (one per list, default all 1) let a more reliable ranking count more."""
    weights = [1.0] * len(rankings) if weights is None else list(weights)
    if len(weights) != len(rankings) or min(weights, default=0.0) < 0:
        raise ValueError(f"reciprocal_rank_fusion: need one non-negative weight per ranking, got {weights} "
                         f"for {len(rankings)} rankings")
    fused: dict[int, float] = {}
    for ranking, w in zip(rankings, weights):
        for rank, item in enumerate(ranking):
            fused[item] = fused.get(item, 0.0) + w / (c + rank + 1)
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
