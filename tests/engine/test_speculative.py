"""Self-speculative decoding with the MTP layer: greedy output equals plain greedy decoding, inside
continuous batching (different prompt lengths, chunked prefill beside decodes, stops), and the sampling
acceptance rule reproduces the target distribution."""

import pytest
import torch

from openglm.engine import EngineConfig, LLMEngine, SamplingParams
from openglm.engine.speculative import accept_greedy, accept_sampled

PROMPTS = ["def main():", "import os\nimport sys\n\nclass Loader(object):\n    def __init__(self, path):", "x",
           "for i in range(10):\n    print(i)\n"]
MAX_TOKENS = [20, 9, 25, 14]


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mtp", index_n_heads=16,
                                   num_nextn_predict_layers=1)


def generate(engine, params_list):
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, params_list)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[i] for i in ids]


def engine_for(path, k, **kw):
    # a small token budget: long prompts are prefilled in chunks while the other rows decode
    return LLMEngine.from_pretrained(path, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=12,
                                                        num_speculative_tokens=k, **kw))


def greedy_params(stops=None):
    return [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m, **(stops or {})) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def reference(mtp_checkpoint):
    return [o.token_ids for o in generate(engine_for(mtp_checkpoint, 0), greedy_params())]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(mtp_checkpoint, reference, k):
    engine = engine_for(mtp_checkpoint, k)
    outs = generate(engine, greedy_params())
    assert [o.token_ids for o in outs] == reference
    assert engine.counters["draft_tokens"] > 0
    assert engine.block_manager.num_used_blocks == 0


def test_accepted_drafts_keep_output_kv_and_stops_exact(mtp_checkpoint, reference, monkeypatch):
    """Drafts that are mostly right (the true continuation, one token in four wrong) exercise multi-token
    acceptance and rejected-slot reuse; a stop token inside an accepted run ends the output there."""
    engine = engine_for(mtp_checkpoint, 3)
    by_prompt = {tuple(engine.check_prompt(p)): ref for p, ref in zip(PROMPTS, reference)}
    propose = engine.speculator.propose

    def oracle(results):
        propose(results)
        for seq in (r.seq for r in results):
            if seq.draft_token_ids:
                ref = by_prompt[tuple(seq.token_ids[: seq.num_prompt_tokens])]
                done = seq.num_output_tokens
                truth = ref[done : done + len(seq.draft_token_ids)]
                wrong = [t if (done + j) % 4 else (t + 1) % 384 for j, t in enumerate(truth)]
                seq.set_drafts(wrong or seq.draft_token_ids)

    monkeypatch.setattr(engine.speculator, "propose", oracle)
    outs = generate(engine, greedy_params())
    assert [o.token_ids for o in outs] == reference
    assert engine.counters["accepted_draft_tokens"] > 10
    stop = reference[0][7]
    outs = generate(engine, greedy_params({"stop_token_ids": [stop]}))
    assert outs[0].token_ids == reference[0][: reference[0].index(stop) + 1] and outs[0].finish_reason == "stop"


def test_engine_without_mtp_layer_refuses_speculation(tiny_checkpoint):
    with pytest.raises(ValueError, match="next-n"):
        LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=16, num_speculative_tokens=1))


def test_greedy_acceptance_takes_longest_matching_prefix():
    logits = torch.full((4, 5), -1.0)
    logits[[0, 1, 2, 3], [2, 4, 1, 3]] = 1.0
    assert accept_greedy([2, 4, 0], logits) == [2, 4, 1]
    assert accept_greedy([2, 4, 1], logits) == [2, 4, 1, 3]
    assert accept_greedy([0, 4, 1], logits) == [2]


def test_sampling_acceptance_reproduces_target_distribution():
    """Drafts drawn from q, verified against p: the first emitted token is distributed as p, and the
    acceptance rate is sum(min(p, q)); with q == p every draft is kept."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    n, first, accepted = 20000, torch.zeros(4), 0
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        out = accept_sampled([x], q, p, gen)
        first[out[0]] += 1
        accepted += len(out) == 2
    assert torch.allclose(first / n, p[0].float(), atol=0.015), first / n
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.015
    same = [accept_sampled([int(torch.multinomial(p[0], 1, generator=gen))], p[:1], p, gen) for _ in range(500)]
    assert all(len(o) == 2 for o in same)


def test_drafts_read_an_int8_copy_of_the_lm_head_kept_in_step(mtp_checkpoint):
    """The MTP drafts' LM head is an int8 copy of the model's (a quarter of fp32's bytes per draft), within half a
    quantisation step of each weight, and rebuilt when the head is updated in place."""
    runner = engine_for(mtp_checkpoint, 1).runner
    w = runner.model.lm_head.weight
    head = runner._draft_head()
    assert head.qdata.dtype == torch.int8 and runner._draft_head() is head
    assert ((head.qdata.float() * head.scale - w.detach()).abs() <= head.scale / 2 + 1e-7).all()
    with torch.no_grad():
        w.mul_(2.0)
    again = runner._draft_head()
    assert again is not head and torch.allclose(again.scale, 2 * head.scale)
