"""The engine's greedy output equals transformers' greedy `generate`, token for token (fp32).

Transformers runs each prompt alone (no padding); the engine batches them all, with and without
chunked prefill, with prefix-cache hits, and under KV-pool pressure that forces preemption.
"""

import pytest
import torch
from testutil import run_requests

from openglm.engine import EngineConfig, LLMEngine, SamplingParams
from openglm.tokenizer import Tokenizer

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 11, 29, 47, 70)


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
    return model


@pytest.fixture(scope="module")
def our_model(tiny_checkpoint):
    from openglm.model import load_model

    return load_model(str(tiny_checkpoint), dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(10, 380, (40,), generator=g).tolist()  # a "system prompt" reused below
    plain = [torch.randint(10, 380, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    with_prefix = [shared + torch.randint(10, 380, (n,), generator=g).tolist() for n in (1, 9, 24)]
    return {"plain": plain, "shared": shared, "with_prefix": with_prefix}


@pytest.fixture(scope="module")
def reference(hf_model):
    cache = {}

    def greedy(prompt):
        key = tuple(prompt)
        if key not in cache:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return greedy


def run(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return run_requests(engine, [(p, params) for p in prompts])


def make_engine(model, checkpoint, **kw):
    return LLMEngine(model, Tokenizer.from_checkpoint(checkpoint), EngineConfig(**kw))


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-shot-prefill", "chunked-prefill"])
def test_batched_greedy_matches_transformers(our_model, tiny_checkpoint, prompts, reference, budget):
    engine = make_engine(our_model, tiny_checkpoint, num_kv_blocks=128, max_num_batched_tokens=budget)
    outs = run(engine, prompts["plain"])
    for prompt, out in zip(prompts["plain"], outs):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert out.outputs[0].token_ids == reference(prompt), f"prompt of {len(prompt)} tokens diverged"
    if budget == 16:
        assert engine.stats().steps > NEW_TOKENS + max(PROMPT_LENGTHS) // 16  # prefill really was chunked
    assert_all_blocks_free(engine)


def test_prefix_cache_hits_keep_greedy_parity(our_model, tiny_checkpoint, prompts, reference):
    engine = make_engine(our_model, tiny_checkpoint, num_kv_blocks=128)
    first = run(engine, [prompts["shared"] + [11, 12]])[0]
    assert first.num_cached_tokens == 0
    outs = run(engine, prompts["with_prefix"])
    for prompt, out in zip(prompts["with_prefix"], outs):
        assert out.num_cached_tokens == 32  # two full 16-token blocks of the shared 40-token prefix
        assert out.outputs[0].token_ids == reference(prompt)
    assert engine.block_manager.stats["prefix_hits"] >= 6
    assert_all_blocks_free(engine)


def test_preemption_by_recompute_keeps_greedy_parity(our_model, tiny_checkpoint, prompts, reference):
    # 5 prompts needing up to ~7 blocks each at the end, in a pool of 14: someone must be preempted
    engine = make_engine(our_model, tiny_checkpoint, num_kv_blocks=14, block_size=16, enable_prefix_caching=False)
    outs = run(engine, prompts["plain"])
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts["plain"], outs):
        assert out.outputs[0].token_ids == reference(prompt)
    assert_all_blocks_free(engine)
