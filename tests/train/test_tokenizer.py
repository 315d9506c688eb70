import pytest

from openglm.tokenizer import (
    CHAT_TEMPLATE,
    MARKERS,
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerError,
    min_vocab_size,
    train_tokenizer,
)

TEXT = 'def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # ünïcode ✓\n'
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2+2"}]


def test_roundtrip_and_special_tokens(tokenizer_dir):
    tok = Tokenizer.from_checkpoint(tokenizer_dir)
    assert tok.vocab_size == 384
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # BPE merged something
    assert tok.encode(TEXT, add_bos=True)[:2] == tok.bos_ids
    assert len({tok.token_id(t) for t in SPECIAL_TOKENS + MARKERS}) == len(SPECIAL_TOKENS + MARKERS)
    assert tok.decode([tok.marker_id("<tool_call>"), tok.token_id("<|user|>")]) == "<tool_call>"  # markers decode
    # special token text in the input is recognised as one token
    assert tok.encode("<|user|>") == [tok.token_id("<|user|>")]


def test_chat_template_renders_glm_roles(tokenizer_dir):
    tok = Tokenizer.from_checkpoint(tokenizer_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == ("[gMASK]<sop><|system|>Be brief.<|user|>Hi?<|assistant|></think>Hello."
                    "<|user|>Sum 2+2<|assistant|><think>")
    ids = tok.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[:2] == tok.bos_ids and ids[-2:] == [tok.token_id("<|assistant|>"), tok.marker_id("<think>")]
    with pytest.raises(TokenizerError, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_loads_in_transformers_with_same_ids_and_template(tokenizer_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = Tokenizer.from_checkpoint(tokenizer_dir)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert hf.decode(ours.encode(TEXT)) == TEXT
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eos_id, ours.pad_id)
    assert hf.convert_tokens_to_ids("<|assistant|>") == ours.token_id("<|assistant|>")
    assert hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(MESSAGES)
    assert (tokenizer_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_vocab_too_small_is_a_clear_error():
    with pytest.raises(TokenizerError, match=f"at least {min_vocab_size()}"):
        train_tokenizer(["x = 1"], vocab_size=100)


def test_empty_training_data_and_missing_file(tmp_path):
    with pytest.raises(TokenizerError, match="empty corpus"):
        train_tokenizer(["", ""], vocab_size=300)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_checkpoint(tmp_path)
