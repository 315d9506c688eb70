import faiss
import numpy as np
import pytest

faiss.omp_set_num_threads(1)  # tests share 2 cores with other work; one thread avoids spin-waits


class MemoEmbedder:
    """The real embedder with a text -> vector memo, so the tests' repeated builds of the same
    files embed each distinct chunk once per session (same vectors, same identity)."""

    def __init__(self, inner):
        self.inner, self.memo = inner, {}
        self.identity, self.model_path, self.dim = inner.identity, inner.model_path, inner.dim

    def encode(self, texts, progress=False):
        todo = sorted({t for t in texts if t not in self.memo})
        for t, v in zip(todo, self.inner.encode(todo)):
            self.memo[t] = v
        return np.stack([self.memo[t] for t in texts]) if texts else self.inner.encode([])


@pytest.fixture(scope="session")
def embedder():
    """The real bundled MiniLM, loaded once per session."""
    from openglm.retrieval.embedder import Embedder

    return MemoEmbedder(Embedder(max_seq_length=128, batch_size=32))
