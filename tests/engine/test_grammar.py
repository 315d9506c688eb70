"""Grammar masks inside continuous batching: a constrained sequence matches its grammar, its batch
neighbours decode exactly as they would alone."""

import json

import pytest
from testutil import run_requests

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.grammar import GrammarError
from openglm.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
GRAMMAR = f"start: answer\nanswer: %json {json.dumps(SCHEMA)}\n"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))


def test_constrained_row_does_not_touch_its_neighbours(engine):
    tok = engine.tokenizer
    prompt = tok.encode("def parse(text):")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (alone,) = run_requests(engine, [(prompt, free)])
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=GRAMMAR,
                                 stop_token_ids=tok.stop_ids)
    together = run_requests(engine, [(prompt, free), (tok.encode("x = "), constrained), (prompt, free)])
    assert together[0].outputs[0].token_ids == alone.outputs[0].token_ids == together[2].outputs[0].token_ids
    out = together[1].outputs[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert set(value) == {"n", "ok"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)


def test_masks_ban_exactly_what_the_matcher_disallows(engine):
    """Each constrained row keeps exactly the tokens llguidance allows, the other rows all of theirs: on the
    fast path (float32 CPU logits, masked through numpy) and the general one (another dtype: masked_fill_)."""
    import types

    import torch

    tok, grammar = engine.tokenizer, engine.grammar
    seqs = [types.SimpleNamespace(matcher=grammar.matcher(GRAMMAR)), types.SimpleNamespace(matcher=None),
            types.SimpleNamespace(matcher=grammar.matcher(GRAMMAR))]
    for t in tok.encode('{"n":'):  # the rows in two different states
        assert seqs[2].matcher.consume_token(t)
    for dtype in (torch.float32, torch.float64):
        logits = torch.zeros(3, engine.vocab_size, dtype=dtype)
        grammar.apply_masks(logits, seqs)
        for row, seq in enumerate(seqs):
            if seq.matcher is None:
                assert torch.isfinite(logits[row]).all()
                continue
            bits = seq.matcher.compute_bitmask()  # llguidance's own: bit k of byte b is token 8 * b + k
            allowed = [k for k in range(engine.vocab_size) if bits[k // 8] >> (k % 8) & 1]
            assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == allowed and allowed


def test_bad_grammar_is_rejected_at_submission(engine):
    with pytest.raises(GrammarError, match="does not compile"):
        engine.grammar.check("start: nope_undefined_rule")
    with pytest.raises(ValueError):
        engine.add_request([1, 2, 3], SamplingParams(grammar="start: ("))
    assert not engine.has_unfinished()
