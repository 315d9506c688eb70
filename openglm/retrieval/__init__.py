"""openglm.retrieval: the code knowledge base (chunking, embeddings, BM25, FAISS ladder index).

The agent-facing API is `CodeIndex`:

    from openglm.retrieval import CodeIndex
    index, stats = CodeIndex.build("repo/")           # incremental on later calls
    for hit in CodeIndex.open("repo/").search("where are retries handled", k=5):
        print(hit.location, hit.name, hit.score)       # path:start-end, qualified name, score

Attributes are resolved lazily so `import openglm.retrieval` stays cheap (no FAISS, no torch).
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "CodeIndex": "openglm.retrieval.code_index",
    "Hit": "openglm.retrieval.code_index",
    "UpdateStats": "openglm.retrieval.code_index",
    "search_repository": "openglm.retrieval.code_index",
    "Chunk": "openglm.retrieval.chunking",
    "chunk_file": "openglm.retrieval.chunking",
    "chunk_python": "openglm.retrieval.chunking",
    "Embedder": "openglm.retrieval.embedder",
    "default_model_path": "openglm.retrieval.embedder",
    "VectorIndex": "openglm.retrieval.vector",
    "VectorConfig": "openglm.retrieval.vector",
    "ladder_config": "openglm.retrieval.vector",
    "STAGES": "openglm.retrieval.vector",
    "BM25Index": "openglm.retrieval.lexical",
    "reciprocal_rank_fusion": "openglm.retrieval.lexical",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
