"""One sequence's failure fails its request alone: the engine finds the offending sequence in the
batch, finishes it with "error", frees its blocks and keeps every other request's output intact."""

import math

import pytest

from openglm.engine import LLM, SamplingParams
from openglm.engine.sampling_params import SamplingParamsError

PROMPTS = ["def main():", "import os\nimport sys\n", "class A:", "x = 1"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), num_kv_blocks=96)


def greedy(**kw):
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_failure_injected_into_one_sequence_fails_that_request_alone(llm, monkeypatch):
    engine = llm.engine
    clean = llm.generate(PROMPTS, greedy(max_tokens=10), use_tqdm=False)
    bad_prompt = engine.tokenizer.encode(PROMPTS[2])
    real_run, calls = engine.runner.run, []

    def run(seqs, num_tokens):  # the third prompt's sequence breaks the model call on its 4th token
        calls.append(len(seqs))
        if any(s.token_ids[: len(bad_prompt)] == bad_prompt and s.num_output_tokens == 3 for s in seqs):
            raise RuntimeError("injected fault")
        return real_run(seqs, num_tokens)

    monkeypatch.setattr(engine.runner, "run", run)
    outs = llm.generate(PROMPTS, greedy(max_tokens=10), use_tqdm=False)
    assert max(calls) == len(PROMPTS), "the fault must hit a batch shared with the other requests"
    failed = outs[2]
    assert failed.error and "injected fault" in failed.error
    assert failed.outputs[0].finish_reason == "error" and len(failed.outputs[0].token_ids) == 3
    for i in (0, 1, 3):  # the others: exactly what they produce without the fault
        assert outs[i].error is None
        assert outs[i].outputs[0].token_ids == clean[i].outputs[0].token_ids
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests
    # and the engine keeps serving
    again = llm.generate(PROMPTS[:1], greedy(max_tokens=10), use_tqdm=False)
    assert again[0].outputs[0].token_ids == clean[0].outputs[0].token_ids


def test_sampler_failure_of_one_sequence_is_isolated(llm, monkeypatch):
    engine = llm.engine
    real = engine.sampler.__class__.__call__

    def sample(self, logits, seqs):
        if any(s.params.seed == 7 for s in seqs):
            raise ValueError("bad row")
        return real(self, logits, seqs)

    monkeypatch.setattr(engine.sampler.__class__, "__call__", sample)
    good = engine.add_request(PROMPTS[0], greedy(max_tokens=6))
    bad = engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=2))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[bad].error and all(c.finish_reason == "error" for c in done[bad].outputs)
    assert done[good].error is None and len(done[good].outputs[0].token_ids) == 6
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", 5e-324), ("temperature", math.nan),
    ("temperature", 2.5), ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("repetition_penalty", True),
    ("min_p", "0"), ("top_k", 10**12), ("n", 17), ("stop_token_ids", list(range(2000))), ("stop_token_ids", [-1]),
    ("stop", ["x" * 5000]), ("presence_penalty", math.inf),
])
def test_out_of_bounds_params_are_refused_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_bounds_that_are_accepted_sample_finite_tokens(llm):
    """The extremes of every bound sample without NaN (so no in-bounds request can fail a batch)."""
    params = SamplingParams(temperature=0.01, repetition_penalty=0.01, presence_penalty=2.0, frequency_penalty=-2.0,
                            min_p=1.0, top_k=1 << 20, seed=2**63 - 1, n=2, max_tokens=4, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert out.error is None and all(len(c.token_ids) == 4 for c in out.outputs)
    params = SamplingParams(temperature=2.0, repetition_penalty=100.0, seed=-(2**63), max_tokens=4, ignore_eos=True)
    assert llm.generate(PROMPTS[1], params, use_tqdm=False)[0].error is None


def test_stop_token_ids_are_a_set():
    assert isinstance(SamplingParams(stop_token_ids=[3, 3, 5]).stop_token_ids, frozenset)
