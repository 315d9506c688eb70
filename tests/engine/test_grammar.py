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


def test_bad_grammar_is_rejected_at_submission(engine):
    with pytest.raises(GrammarError, match="does not compile"):
        engine.grammar.check("start: nope_undefined_rule")
    with pytest.raises(ValueError):
        engine.add_request([1, 2, 3], SamplingParams(grammar="start: ("))
    assert not engine.has_unfinished()
