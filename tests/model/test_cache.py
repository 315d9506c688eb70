"""Incremental decoding: prefill + decode steps with DynamicCache equals one full forward."""

from __future__ import annotations

import pytest
import torch

from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.cache import KeyShadow

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


def _entries(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(B, T, 6, generator=g), "k_pe": torch.randn(B, T, 2, generator=g),
            "index_k": torch.randn(B, T, 3, generator=g)}


def test_dynamic_cache_writes_in_place_grows_and_returns_the_concatenation():
    from openglm.model.cache import CAPACITY_STEP

    cache = DynamicCache()
    chunks = [_entries(2, CAPACITY_STEP - 1, 0)] + [_entries(2, 1, s) for s in range(1, 4)]
    for i, chunk in enumerate(chunks):
        out = cache.update(0, chunk)
        want = {k: torch.cat([c[k] for c in chunks[:i + 1]], 1) for k in chunk}
        assert all(torch.equal(out[k], want[k]) for k in want)
    assert cache.get_seq_length() == CAPACITY_STEP + 2  # grew past the first buffer
    before = cache.layers[0]["kv"].data_ptr()
    cache.update(0, _entries(2, 1, 9))  # room left: no reallocation, same storage
    assert cache.layers[0]["kv"].data_ptr() == before
    with pytest.raises(KeyError, match="index_k"):
        cache.update(0, {"kv": torch.zeros(2, 1, 6), "k_pe": torch.zeros(2, 1, 2)})
    with pytest.raises(ValueError, match="k_pe"):
        cache.update(0, {**_entries(2, 1, 5), "k_pe": torch.zeros(2, 1, 5)})
    cache.reorder(torch.tensor([1]))
    assert cache.layers[0]["kv"].shape == (1, CAPACITY_STEP + 3, 6)


def test_cache_entries_of_different_dtypes_keep_their_dtype():
    cache = DynamicCache()
    e = {"kv": torch.randn(1, 2, 4, dtype=torch.bfloat16), "index_k": torch.randn(1, 2, 3)}
    out = cache.update(3, e)
    assert out["kv"].dtype == torch.bfloat16 and out["index_k"].dtype == torch.float32
    assert torch.equal(out["index_k"], e["index_k"]) and torch.equal(out["kv"], e["kv"])


def test_latent_keys_are_a_zero_copy_view_of_the_cache_and_equal_the_concatenation():
    from openglm.model.glm5.mla import latent_keys
    from openglm.model.glm5.sparse_dsa import gather_attention

    cache = DynamicCache()
    cache.update(0, _entries(3, 10, 1))
    out = cache.update(0, _entries(3, 1, 2))
    keys = latent_keys(out["kv"], out["k_pe"])
    want = torch.cat([out["kv"], out["k_pe"]], -1).unsqueeze(2)
    assert torch.equal(keys, want)
    assert keys.untyped_storage().data_ptr() == out["kv"].untyped_storage().data_ptr()
    separate = latent_keys(out["kv"].clone(), out["k_pe"].clone())  # not adjacent: a copy, same values
    assert torch.equal(separate, want)
    # DSA's gathered attention reads rows of the strided cache view exactly like a contiguous copy
    q = torch.randn(3, 4, 1, 8)
    idx = torch.randint(0, 11, (3, 1, 5))
    k, k_copy = keys.transpose(1, 2), want.contiguous().transpose(1, 2)
    got = gather_attention(q, k, k[..., :6], idx, scale=0.4)
    assert torch.allclose(got, gather_attention(q, k_copy, k_copy[..., :6], idx, scale=0.4), atol=1e-6)


def test_hidden_states_then_logits_of_the_last_positions_equal_forward():
    """The hidden-state entry and the LM head over the positions a caller keeps give forward's logits there, with
    and without autograd, and on a cache (a chunked prefill's next chunk)."""
    m = _model()
    ids = torch.randint(3, m.config.vocab_size, (2, 9))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            full = m(ids).logits
            hidden = m.hidden_states(ids)
            last = m.logits(m.hidden_states(ids, last=2))
        assert hidden.shape == (2, 9, m.config.hidden_size) and last.shape == (2, 2, m.config.vocab_size)
        assert torch.allclose(m.logits(hidden), full, atol=1e-6) and torch.allclose(last, full[:, -2:], atol=1e-6)
    with torch.no_grad():
        cache = DynamicCache()
        m.hidden_states(ids[:, :5], cache=cache, last=1)
        assert torch.allclose(m.logits(m.hidden_states(ids[:, 5:], cache=cache)), full[:, 5:], atol=1e-5)


def test_key_shadow_bounds_each_key_within_half_a_step():
    keys = torch.randn(40, 32) * torch.rand(40, 1) * 10
    keys[3] = 0.0
    shadow = KeyShadow(64, 32)
    slots = torch.randperm(64)[:40]
    shadow.write(slots, keys)
    codes = shadow.codes[slots // 16, :, slots % 16].reshape(40, 32).float()
    scale = shadow.scale[slots]
    assert ((keys - codes * scale[:, None]).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()
    assert codes.abs().amax(1)[torch.arange(40) != 3].eq(127).all() and scale[3] == 0 and codes[3].eq(0).all()
    assert KeyShadow.for_keys(64, 30) is None  # VNNI's 4-byte groups: other widths scan the keys themselves


def _assert_shadow_matches_keys(buf) -> None:
    cap, n, width = buf.data.shape[1], buf.length, buf.widths[0]
    slots = (torch.arange(buf.batch)[:, None] * cap + torch.arange(n)).flatten()
    expected = KeyShadow(buf.batch * cap, width)
    expected.write(slots, buf.data[:, :n].reshape(-1, width))
    assert torch.equal(buf.shadow.scale[slots], expected.scale[slots])
    assert torch.equal(buf.shadow.codes[slots // 16, :, slots % 16], expected.codes[slots // 16, :, slots % 16])


def test_index_key_shadow_follows_growth_and_reorder():
    """The `index_k` buffer's shadow holds every filled slot's codes, as `KeyShadow.write` makes them from the keys
    the buffer holds, after appends that regrow the buffer and after a reorder (beam search)."""
    cache, g = DynamicCache(), torch.Generator().manual_seed(0)
    for t in (5, 300, 1, 40):  # 5 + 300 outgrows the first 256-slot capacity
        cache.update(0, {"index_k": torch.randn(2, t, 8, generator=g)})
    buf = cache._buffers[0][0]
    _assert_shadow_matches_keys(buf)
    cache.reorder(torch.tensor([1, 1]))
    buf = cache._buffers[0][0]
    assert torch.equal(buf.data[0], buf.data[1]) and buf.length == 346
    _assert_shadow_matches_keys(buf)
    cache.update(0, {"index_k": torch.randn(2, 3, 8, generator=g)})
    _assert_shadow_matches_keys(cache._buffers[0][0])
