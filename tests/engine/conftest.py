import pytest
import torch

# Small matmuls on a shared 2-core machine: extra OpenMP threads only spin against each other.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Random-weight `tiny` model + a BPE tokenizer trained on stdlib sources.

    16 indexer heads (instead of the preset's 4): DSA's relu scores are exactly 0 for a key whenever
    every head's dot product is negative, and exact ties at the top-k boundary are broken
    arbitrarily by torch.topk (differently for differently padded rows, in transformers as here).
    With 16 heads such ties essentially never occur, so token-for-token parity is well defined."""
    from openglm.engine.random_checkpoint import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", index_n_heads=16)
