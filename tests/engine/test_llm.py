"""The offline API `LLM(path).generate(...)`: stops, lengths, n, seeds, logprobs, abort, chat."""

import pytest

from openglm.engine import LLM, SamplingParams
from openglm.engine.llm_engine import PromptError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint), num_kv_blocks=96)


def greedy(**kw):
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_generate_keeps_prompt_order_and_counts_tokens(llm):
    prompts = ["def main():", "import os\nimport sys\n", "x"]
    outs = llm.generate(prompts, greedy(max_tokens=12), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in prompts]
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_stop_string_truncates_text(llm):
    base = llm.generate("class A:", greedy(max_tokens=24), use_tqdm=False)[0].outputs[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    out = llm.generate("class A:", greedy(max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.index(stop)]
    kept = llm.generate("class A:", greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base[: base.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    tokens = llm.generate("return", greedy(max_tokens=16), use_tqdm=False)[0].outputs[0].token_ids
    target = tokens[5]
    out = llm.generate("return", greedy(max_tokens=16, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_n_and_seed_are_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, n=3, seed=1234, max_tokens=10, ignore_eos=True)
    a = llm.generate("for i in", params, use_tqdm=False)[0]
    b = llm.generate("for i in", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the n samples differ from each other


def test_logprobs_are_reported_per_token(llm):
    out = llm.generate("if x:", greedy(max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        assert len(entry["top"]) == 3 and entry["top"][0][0] == token  # greedy picks the top token


def test_abort_returns_blocks(llm):
    engine = llm.engine
    rid = engine.add_request("while True:", greedy(max_tokens=200))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    assert not engine.abort(rid)


def test_stats_and_abort_all(llm):
    engine = llm.engine
    ids = [engine.add_request(p, greedy(max_tokens=50)) for p in ("def f():", "class A:")]
    before = engine.stats()
    engine.step()
    now = engine.stats()
    assert now.running == 2 and now.waiting == 0 and now.kv_blocks_used > 0 and now.steps == before.steps + 1
    assert now.kv_blocks_total == engine.block_manager.num_blocks and now.prompt_tokens > before.prompt_tokens
    assert engine.model_config is engine.runner.model.config  # the public name of the served config
    engine.abort_all()
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished() and not any(map(engine.abort, ids))


def test_chat_uses_the_checkpoint_template(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "[gMASK]<sop><|user|>hello<|assistant|><think>"
    out = llm.chat([{"role": "user", "content": "hello"}], greedy(max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(text)


def test_prompt_longer_than_context_is_rejected(tiny_checkpoint):
    small = LLM(str(tiny_checkpoint), num_kv_blocks=8, max_model_len=64)
    with pytest.raises(PromptError, match="context") as e:
        small.generate([list(range(10, 80))], greedy(max_tokens=4), use_tqdm=False)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(tiny_checkpoint), num_blocks=8)


@pytest.mark.parametrize("prompt, message", [([], "empty"), ("", "empty"), ([1, -1], r"\[0, "), ([1, 10**6], r"\[0, ")])
def test_bad_prompts_are_refused_by_the_one_check(llm, prompt, message):
    engine = llm.engine
    with pytest.raises(PromptError, match=message) as e:
        engine.add_request(prompt, greedy(max_tokens=2))
    assert e.value.code is None and not engine.has_unfinished()
    assert engine.check_prompt("def f():") == llm.tokenizer.encode("def f():")


def test_reported_text_is_never_taken_back(llm):
    """While a request runs its reported text holds back what may still become a stop string: each output adds
    to what the previous ones reported (the server streams that), and they add up to the whole output."""
    out = llm.generate("class A:", greedy(max_tokens=24), use_tqdm=False)[0].outputs[0]
    base = out.text
    # a stop string across two tokens (first seen there): its first part arrives a step before the rest
    cuts = [len(llm.tokenizer.decode(out.token_ids[:k])) for k in range(4, len(out.token_ids) - 2)]
    stop = next(base[c - 1: c + 2] for c in cuts
                if len(base[c - 1: c + 2]) == 3 and base.index(base[c - 1: c + 2]) == c - 1)
    engine = llm.engine
    engine.add_request("class A:", SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, n=2, stop=[stop]))
    reports: dict[int, list[str]] = {0: [""], 1: [""]}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                assert c.text_offset == len(reports[c.index][-1])
                reports[c.index].append(reports[c.index][-1] + c.delta_text)
                if out.finished:
                    assert c.text == reports[c.index][-1]
    for texts in reports.values():
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert texts[-1] == base[: base.index(stop)]
        assert any(len(t) < len(base[: base.index(stop)]) for t in texts[1:-1])  # it streamed in pieces
