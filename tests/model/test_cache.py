"""Incremental decoding: prefill + decode steps with DynamicCache equals one full forward."""

from __future__ import annotations

import torch

from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig

TOL = 1e-4


def _model(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=8, **overrides)
    m = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():  # larger weights than the 0.02 init so attention patterns are not flat
            if p.dim() > 1:
                p.normal_(0, 0.15)
    return m


def _decode_logits(m, ids, mask, n_prefill):
    cache = DynamicCache()
    steps = [m(ids[:, :n_prefill], attention_mask=mask[:, :n_prefill], cache=cache).logits]
    for t in range(n_prefill, ids.shape[1]):
        steps.append(m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
        assert cache.get_seq_length() == t + 1
    return torch.cat(steps, 1), cache


def test_prefill_plus_16_decode_steps_equals_full_forward(padded_batch):
    m = _model()
    ids, mask, _ = padded_batch(m.config.vocab_size, [26, 20, 11], left=True)
    with torch.no_grad():
        full = m(ids, attention_mask=mask).logits
        inc, cache = _decode_logits(m, ids, mask, n_prefill=10)
    assert ids.shape[1] - 10 == 16
    assert (full - inc).abs()[mask.bool()].max() <= TOL
    # MLA caches the latent + rope key (+ indexer key on 'full' layers), never per-head K/V.
    layer0, layer1 = cache.layers[0], cache.layers[1]
    assert set(layer0) == {"kv", "k_pe", "index_k"} and set(layer1) == {"kv", "k_pe"}
    assert layer0["kv"].shape == (3, 26, m.config.kv_lora_rank)
    assert layer0["k_pe"].shape == (3, 26, m.config.qk_rope_head_dim)
    assert layer0["index_k"].shape == (3, 26, m.config.index_head_dim)


def test_decode_without_mask_and_dense_layers_match():
    m = _model(attention_kinds=["dsa", "dsa", "dense"], indexer_types=["full", "shared", "shared"])
    ids = torch.randint(3, m.config.vocab_size, (2, 24))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = m(ids).logits
        cache = DynamicCache()
        steps = [m(ids[:, :8], cache=cache).logits]
        steps += [m(ids[:, t:t + 1], cache=cache).logits for t in range(8, 24)]
    assert (full - torch.cat(steps, 1)).abs().max() <= TOL
    assert (full - _decode_logits(m, ids, mask, 8)[0]).abs().max() <= TOL


def test_chunked_prefill_matches():
    """Several tokens at a time on top of a cache (the engine's chunked prefill) also agrees."""
    m = _model(attn_query_chunk=3)
    ids = torch.randint(3, m.config.vocab_size, (2, 21))
    with torch.no_grad():
        full = m(ids).logits
        cache = DynamicCache()
        parts = [m(ids[:, a:b], cache=cache).logits for a, b in ((0, 5), (5, 12), (12, 21))]
    assert (full - torch.cat(parts, 1)).abs().max() <= TOL
