"""The engine on a hybrid model (glm5_next: KDA linear attention + pooled DSA): per-sequence KDA state slots beside
the paged latent cache, through continuous batching, chunked prefill, abort, preemption and a failed step. Its
greedy tokens (and their logprobs) on a random tiny-glm5-next checkpoint equal the model's own greedy loop, and every
state slot comes back."""

from __future__ import annotations

import pytest
import torch

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.sampling_params import SamplingParams
from openglm.model import ModelConfig, build_model

MAX_TOKENS = 10
VOCAB = 384


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    # 16 index heads: no exact zero-score ties at the pooled top-k (see conftest.py); index_topk 8 in groups of
    # 4, so every prompt here runs the sparse selection
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "glm5next", preset="tiny-glm5-next",
                                   index_n_heads=16)


@pytest.fixture(scope="module")
def model(checkpoint):
    from openglm.model import load_model

    model = load_model(str(checkpoint)).eval()
    assert model.config.model_type == "glm5_next" and model.config.vocab_size == VOCAB
    return model


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, prompt, n=MAX_TOKENS):
    """The model's own greedy loop (a full forward per token, no cache): tokens and their logprobs."""
    ids, tokens, lps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(n):
            logp = model(ids).logits[0, -1].float().log_softmax(-1)
            nxt = int(logp.argmax())
            tokens.append(nxt)
            lps.append(float(logp[nxt]))
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tokens, lps


def run(engine, requests, on_step=None):
    """Step the engine until done: {request id: (token ids, logprobs)} of the requests that finished normally."""
    done, step = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                o = out.outputs[0]
                done[out.request_id] = (o.token_ids, [e["logprob"] for e in o.logprobs])
        step += 1
        if on_step is not None:
            on_step(step)
    return done


def add(engine, ps, max_tokens=MAX_TOKENS):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    return [engine.add_request(p, params) for p in ps]


def check_equal(model, ps, ids, done):
    for rid, p in zip(ids, ps):
        tokens, lps = reference(model, p)
        assert done[rid][0] == tokens, f"prompt of {len(p)} tokens"
        assert max(abs(a - b) for a, b in zip(done[rid][1], lps)) < 1e-4


def check_released(engine):
    slots, bm = engine.scheduler.state_slots, engine.block_manager
    assert slots.num_free == slots.num_slots and bm.num_used_blocks == 0


def test_batch_with_chunked_prefill_and_abort_equals_model_greedy(checkpoint, model):
    # the engine loads the checkpoint itself (its own copy of the weights, and the tokenizer)
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(num_kv_blocks=64, block_size=16,
                                                                max_num_batched_tokens=16))
    ps = prompts([5, 19, 33, 47])
    ids = add(engine, ps)
    victim = engine.add_request(prompts([40], seed=2)[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    seen = {}

    def abort_mid_prefill(step):
        (seq,) = engine.requests.get(victim, [None])
        if seq is not None and 0 < seq.num_computed_tokens < seq.num_prompt_tokens and "slot" not in seen:
            seen["slot"], seen["free"] = seq.state_slot, engine.scheduler.state_slots.num_free
            assert engine.abort(victim)
            assert seq.state_slot is None and engine.scheduler.state_slots.num_free == seen["free"] + 1

    done = run(engine, [], abort_mid_prefill)
    assert seen["slot"] is not None, "the aborted request never ran a partial prefill"
    assert victim not in done
    check_equal(model, ps, ids, done)
    check_released(engine)
    # chunked prefill happened (the 47-token prompt cannot fit one 16-token step) and prefix caching is off
    assert engine.counters["steps"] > 47 // 16 and not engine.block_manager.enable_prefix_caching
    assert any("prefix caching is off" in n for n in engine.notes)
    assert any("torch reference path" in n for n in engine.notes)
    # the state pool grew with the sequences running at once (5), not to max_num_seqs (32)
    assert 5 <= engine.runner.states.capacity < engine.runner.states.num_slots == 32


def test_preemption_recomputes_state(model):
    # 7 blocks of 8 tokens for 3 sequences of 20-30 tokens + 10 outputs each: the pool runs dry mid-decode
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=7, block_size=8, max_num_batched_tokens=64))
    ps = prompts([20, 26, 30], seed=3)
    ids = add(engine, ps)
    done = run(engine, [])
    assert engine.scheduler.num_preemptions > 0
    check_equal(model, ps, ids, done)
    check_released(engine)


def test_more_requests_than_state_slots(model):
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=2))
    assert engine.runner.states.num_slots == 2
    ps = prompts([6, 9, 12, 15, 18], seed=4)
    ids = add(engine, ps)
    peak = []
    done = run(engine, [], lambda _: peak.append(len(engine.scheduler.running)))
    assert max(peak) == 2 and engine.runner.states.capacity == 2
    check_equal(model, ps, ids, done)
    check_released(engine)


def test_failed_step_reruns_from_the_state_it_started_with(model, monkeypatch):
    """A step that raises after the KDA layers wrote their new state (in the last layer, an indexed one) is run
    again one sequence at a time by the engine: each must start again from the state before the step."""
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=16))
    last = model.model.layers[-1]
    assert last.self_attn.kind != "linear" and model.model.layers[0].self_attn.kind == "linear"
    failed = []
    forward = type(last).forward

    def fail_once(self, streams, *args, **kw):
        kind = "prefill" if streams.shape[1] > 1 else "decode"
        if self is last and streams.shape[0] > 1 and kind not in failed:  # a batched step, once each (reruns: 1 row)
            failed.append(kind)
            raise RuntimeError("injected")
        return forward(self, streams, *args, **kw)

    monkeypatch.setattr(type(last), "forward", fail_once)
    # step 2 runs the last 8 tokens of the first prompt and the first 8 of the second in one batch
    ps = prompts([24, 24], seed=5)
    ids = add(engine, ps)
    done = run(engine, [])
    monkeypatch.undo()
    assert sorted(failed) == ["decode", "prefill"]
    check_equal(model, ps, ids, done)
    check_released(engine)


def test_hybrid_refuses_mtp_drafts(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(model, None, EngineConfig(num_speculative_tokens=1))


def test_tensor_parallel_serving_of_kda_layers_is_refused(model):
    from openglm.engine.parallel import check_shardable
    from openglm.model.parallel import LayoutError

    check_shardable(model.config, 1)
    with pytest.raises(LayoutError, match="linear-attention"):
        check_shardable(model.config, 2)


def test_non_hybrid_model_keeps_prefix_caching():
    torch.manual_seed(0)
    engine = LLMEngine(build_model(ModelConfig.from_preset("tiny")).eval(), None, EngineConfig(num_kv_blocks=8))
    assert engine.notes == [] and engine.runner.states is None and engine.scheduler.state_slots is None
    assert engine.block_manager.enable_prefix_caching
