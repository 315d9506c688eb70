"""Shared fixtures for the training tests: a tiny code corpus and a tokenizer trained on it."""

from __future__ import annotations

import textwrap

import pytest

SNIPPETS = [
    '''
    def add(a, b):
        """Return the sum of a and b."""
        return a + b
    ''',
    '''
    class Stack:
        def __init__(self):
            self.items = []

        def push(self, item):
            self.items.append(item)

        def pop(self):
            return self.items.pop()
    ''',
    '''
    def fibonacci(n):
        if n < 2:
            return n
        return fibonacci(n - 1) + fibonacci(n - 2)
    ''',
    '''
    import os

    def list_files(path):
        for name in sorted(os.listdir(path)):
            if not name.startswith("."):
                yield os.path.join(path, name)
    ''',
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """A folder of 40 small Python files (variations of a few snippets)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        body = textwrap.dedent(SNIPPETS[i % len(SNIPPETS)]).replace("a, b", f"a{i}, b").replace("(a + b", f"(a{i} + b")
        (root / f"mod_{i:02d}.py").write_text(f"# module {i}\n" + body * 3)
    (root / "data.bin").write_bytes(b"\x00\x01binary")  # must be skipped
    return root


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_dir):
    from openglm.tokenizer import train_tokenizer
    from openglm.train.data import load_documents

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([d.text for d in load_documents(str(corpus_dir))], vocab_size=384, out_dir=out)
    return out


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest single-threaded, and the test machine is shared."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg(tmp_path, corpus_dir, tokenizer_dir):
    """A TrainConfig factory for the tiny preset on the tiny corpus (fp32, so results are exact)."""
    from openglm.train.config import TrainConfig

    def make(**changes):
        base = dict(out_dir=str(tmp_path / "run"), data=str(corpus_dir), tokenizer=str(tokenizer_dir), preset="tiny",
                    seq_len=32, batch_size=4, max_steps=8, lr=3e-3, warmup_steps=2, dtype="fp32", log_every=2,
                    eval_every=4, eval_windows=4, save_every=4, progress=False, plots=False, val_fraction=0.1)
        return TrainConfig(**{**base, **changes})

    return make
