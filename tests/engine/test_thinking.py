"""The thinking budget: after N reasoning tokens the next one is `</think>`, in its own row only."""

import pytest
from testutil import run_requests

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))


def ids(engine):
    tok = engine.tokenizer
    return tok.marker_id("<think>"), tok.marker_id("</think>")


def sampling(engine, **kw):
    return SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, **kw)


def test_the_budget_forces_think_end_and_leaves_neighbours_alone(engine):
    prompt = engine.tokenizer.encode("def parse(text):")
    think = ids(engine)
    (free,) = run_requests(engine, [(prompt, sampling(engine))])
    free = free.outputs[0].token_ids
    assert think[1] not in free[:6]  # so the forced token below is the budget's doing
    outs = run_requests(engine, [(prompt, sampling(engine, thinking_budget=5, think_ids=think)),
                                 (prompt, sampling(engine)),
                                 (prompt, sampling(engine, thinking_budget=0, think_ids=think))])
    budgeted, neighbour, zero = (o.outputs[0].token_ids for o in outs)
    assert budgeted[:5] == free[:5] and budgeted[5] == think[1]
    assert budgeted[6:].count(think[1]) == free[6:].count(think[1])  # forced once: after it the model is free
    assert neighbour == free
    assert zero[0] == think[1]


def test_a_model_opened_reasoning_counts_from_its_think(engine):
    """thinking_open=False (GLM-4.5/4.6 prompts): the budget counts from a leading <think> the model writes."""
    tok = engine.tokenizer
    think = ids(engine)
    grammar = f'start: "\\n"? <[{think[0]}]> R <[{think[1]}]> "done"\nR: /(.|\\n)*/\n'
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2, grammar=grammar, stop_token_ids=tok.stop_ids,
                            thinking_budget=3, think_ids=think, thinking_open=False)
    (out,) = run_requests(engine, [(tok.encode("x = "), params)])
    tokens = out.outputs[0].token_ids
    start = tokens.index(think[0]) + 1
    # 3 reasoning tokens, then </think> as soon as the grammar allows it (a byte-level token may have split a
    # character the reasoning's regex must finish first: at most 3 more bytes)
    assert 3 <= tokens.index(think[1]) - start <= 6 and out.outputs[0].text.endswith("</think>done")
    # without a <think> from the model the reasoning never opens: nothing is forced
    prompt = tok.encode("def parse(text):")
    (free,) = run_requests(engine, [(prompt, sampling(engine))])
    (late,) = run_requests(engine, [(prompt, sampling(engine, thinking_budget=0, think_ids=think,
                                                     thinking_open=False))])
    assert free.outputs[0].token_ids[0] != think[0] and late.outputs[0].token_ids == free.outputs[0].token_ids


def test_an_end_token_closes_the_reasoning_so_nothing_is_forced(engine):
    """think_end_ids (a `<tool_call>`, where the output parser reads a call as the end of the reasoning): once
    one is written the budget no longer applies, so a call is never cut by a forced `</think>`."""
    prompt = engine.tokenizer.encode("def parse(text):")
    think = ids(engine)
    (free,) = run_requests(engine, [(prompt, sampling(engine))])
    free = free.outputs[0].token_ids
    end = free[2]  # the model's own third token stands in for a <tool_call>
    (budgeted,) = run_requests(engine, [(prompt, sampling(engine, thinking_budget=5, think_ids=think))])
    (ended,) = run_requests(engine, [(prompt, sampling(engine, thinking_budget=5, think_ids=think,
                                                       think_end_ids=(end,)))])
    assert budgeted.outputs[0].token_ids[5] == think[1] != free[5]
    assert ended.outputs[0].token_ids == free


def test_budget_fields_are_checked():
    with pytest.raises(SamplingParamsError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1, think_ids=(1, 2))
    with pytest.raises(SamplingParamsError, match="think_ids"):
        SamplingParams(thinking_budget=4)
    with pytest.raises(SamplingParamsError, match="think_end_ids"):
        SamplingParams(think_end_ids=[3])
