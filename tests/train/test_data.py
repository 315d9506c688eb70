import json

import numpy as np
import pytest

from openglm.train.data import (
    CorpusError,
    PackedBatcher,
    eval_windows,
    load_documents,
    split_documents,
    tokenize_documents,
    unigram_loss,
)


def test_folder_corpus_skips_binary_and_splits_deterministically(corpus_dir):
    docs = load_documents(str(corpus_dir))
    assert len(docs) == 40 and all(d.name.endswith(".py") for d in docs)
    train, val = split_documents(docs, val_fraction=0.1)
    assert len(val) == 4 and len(train) == 36
    assert not {d.name for d in train} & {d.name for d in val}
    train2, val2 = split_documents(list(reversed(docs)), val_fraction=0.1)
    assert [d.name for d in val2] == [d.name for d in val]


def test_stdlib_corpus_is_real_python():
    docs = load_documents("stdlib")
    names = {d.name for d in docs}
    assert "os.py" in names and "json/decoder.py" in names
    assert not any(n.startswith(("test/", "idlelib/")) for n in names)


def test_jsonl_corpus_and_bad_lines(tmp_path):
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps({"text": "a = 1"}) + "\n\n" + json.dumps({"text": "b = 2", "meta": 1}) + "\n")
    assert [d.text for d in load_documents(str(good))] == ["a = 1", "b = 2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: .*'text'"):
        load_documents(str(bad))


def test_missing_and_empty_corpus(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_documents(str(tmp_path / "nope"))
    (tmp_path / "empty.py").write_text("   \n")
    with pytest.raises(CorpusError, match="empty"):
        load_documents(str(tmp_path))


def test_tokenize_appends_eos_per_document(corpus_dir, tokenizer_dir):
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(tokenizer_dir)
    docs = load_documents(str(corpus_dir))[:3]
    stream = tokenize_documents(docs, tok)
    assert stream.dtype == np.int32 and (stream == tok.eos_id).sum() == 3
    assert tok.decode(stream[:len(tok.encode(docs[0].text))].tolist()) == docs[0].text


def test_batcher_resume_and_rank_shares():
    tokens = np.arange(1001, dtype=np.int32)
    a = PackedBatcher(tokens, seq_len=10, seed=3)  # 100 windows
    first = [a.next_batch(8) for _ in range(20)]  # crosses an epoch boundary at 100 windows
    assert a.epoch == 1
    seen = np.concatenate([b[:, 0] for b in first[:13]])[:100]
    assert sorted(seen.tolist()) == list(range(0, 1000, 10))  # each window exactly once per epoch
    assert all((b[:, 1:] - b[:, :-1] == 1).all() for b in first)  # windows are contiguous spans of seq_len+1
    b = PackedBatcher(tokens, seq_len=10, seed=3)
    for _ in range(7):
        b.next_batch(8)
    c = PackedBatcher(tokens, seq_len=10, seed=3)
    c.load_state_dict(b.state_dict())
    assert np.array_equal(c.next_batch(8), first[7])
    # two ranks each take their half of the same global batch
    r0, r1 = PackedBatcher(tokens, 10, seed=3), PackedBatcher(tokens, 10, seed=3)
    assert np.array_equal(np.concatenate([r0.next_batch(8, 0, 2), r1.next_batch(8, 1, 2)]), first[0])
    with pytest.raises(CorpusError, match="seq_len"):
        PackedBatcher(tokens, seq_len=20, seed=3).load_state_dict(b.state_dict())
    with pytest.raises(CorpusError, match="too small"):
        PackedBatcher(np.arange(5, dtype=np.int32), seq_len=10)


def test_eval_windows_and_unigram_baseline():
    tokens = np.arange(101, dtype=np.int32)
    w = eval_windows(tokens, seq_len=10, max_windows=4)
    assert w.shape == (4, 11) and w[0, 0] == 0 and w[-1, 0] == 90
    uniform = unigram_loss(np.arange(8), np.arange(8), vocab_size=8)
    assert uniform == pytest.approx(np.log(8))
    skewed = unigram_loss(np.zeros(1000, dtype=np.int64), np.zeros(10, dtype=np.int64), vocab_size=8)
    assert skewed < 0.01
