"""openglm.retrieval: the code knowledge base (chunking, embeddings, BM25, FAISS ladder index).

The agent-facing API is `CodeIndex`:

    from openglm.retrieval import CodeIndex
    index, stats = CodeIndex.build("repo/")           # incremental on later calls
    for hit in CodeIndex.open("repo/").search("where are retries handled", k=5):
        print(hit.location, hit.name, hit.score)       # path:start-end, qualified name, score

Attributes are resolved lazily so `import openglm.retrieval` stays cheap (no FAISS, no torch).
"""

_EXPORTS = {
    "CodeIndex": "code_index", "Hit": "code_index", "UpdateStats": "code_index",
    "Chunk": "chunking", "chunk_file": "chunking", "chunk_python": "chunking",
    "Embedder": "embedder", "default_model_path": "embedder",
    "VectorIndex": "vector", "VectorConfig": "vector", "ladder_config": "vector", "STAGES": "vector",
    "BM25Index": "lexical", "reciprocal_rank_fusion": "lexical",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
