"""The native decode step (`model/glm5/decode_step.py`: three C calls per MLA layer) equals the torch path: logits and
cache entries, with DSA selection active (more keys than index_topk), own and shared indexers, group-limited
routing, several sequences, several new tokens per sequence (speculative verification), dense-kind MLA layers,
int8 weights, exact ties at the k-th index score, weight updates and forward hooks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.cache import KeyShadow, _IndexKeyBuffer
from openglm.model.glm5.decode_step import DecodePlan
from openglm.model.native import decode_kernels

pytestmark = pytest.mark.needs_native
CREATE = DecodePlan.create.__func__  # before any test wraps it


def _model(preset: str = "tiny", dtype=torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    m = GlmMoeDsaForCausalLM(ModelConfig.from_preset(preset, **{"index_topk": 6, **overrides})).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in m.model.layers:  # a correction bias that changes which experts win
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return m.to(dtype)


class Spy:
    """Counts the forwards that took the native path; `off()` forces the torch path."""

    def __init__(self, monkeypatch):
        self.used, self.enabled = 0, True

        def spy(cls, *args, **kwargs):
            plan = CREATE(cls, *args, **kwargs) if self.enabled else None
            self.used += plan is not None
            return plan

        monkeypatch.setattr(DecodePlan, "create", classmethod(spy))


def _decode(m, prompt, steps, new: int = 1):
    """Logits of `steps` decode calls of `new` tokens each after `prompt`, and the cache's entries."""
    g = torch.Generator().manual_seed(5)
    cache, out = DynamicCache(), []
    with torch.no_grad():
        m(prompt, cache=cache)
        for _ in range(steps):
            ids = torch.randint(3, m.config.vocab_size, (prompt.shape[0], new), generator=g)
            out.append(m(ids, cache=cache).logits.float())
    return torch.cat(out, 1), cache.layers


def _both_paths(monkeypatch, m, prompt, steps, new=1):
    spy = Spy(monkeypatch)
    native = _decode(m, prompt, steps, new)
    used, spy.enabled = spy.used, False
    torch_path = _decode(m, prompt, steps, new)
    return native, torch_path, used


@pytest.mark.parametrize("batch,new", [(1, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("preset", ["tiny", "tiny-glm4-moe-lite"])
def test_native_decode_equals_the_torch_path_in_fp32(monkeypatch, preset, batch, new):
    m = _model(preset)
    prompt = torch.randint(3, m.config.vocab_size, (batch, 9), generator=torch.Generator().manual_seed(1))
    (a, cache_a), (b, cache_b), used = _both_paths(monkeypatch, m, prompt, steps=4, new=new)
    assert used == 4  # every decode call ran natively (the 9-token prompt did not)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    for layer in cache_b:
        for name, ref in cache_b[layer].items():  # the entries the native calls wrote are the torch path's
            assert (cache_a[layer][name] - ref).abs().max() <= 1e-5 * ref.abs().max(), (layer, name)


def test_native_decode_in_bf16_is_as_close_to_fp32_as_the_torch_path(monkeypatch):
    """bf16 rounds at the same points on both paths, but sums in another order: measured against the fp32 model,
    the native step's error stays within the torch path's."""
    ref = _decode(_model("tiny"), torch.arange(3, 12)[None], 6)[0]
    (a, _), (b, _), used = _both_paths(monkeypatch, _model("tiny", torch.bfloat16), torch.arange(3, 12)[None], 6)
    assert used == 6
    err_native, err_torch = (a - ref).abs().max(), (b - ref).abs().max()
    assert err_native <= 1.5 * err_torch + 0.01 * ref.abs().max(), (err_native, err_torch)


def test_native_decode_with_int8_weights_equals_the_torch_path(monkeypatch):
    from openglm.engine.quant import quantize_model  # the engine's quantiser: the weights `serve --quantization` holds

    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 0.05)]:
        m = _model("tiny", dtype)
        quantize_model(m, "int8")
        (a, _), (b, _), used = _both_paths(monkeypatch, m, torch.arange(3, 12)[None], 4)
        assert used == 4
        assert (a - b).abs().max() <= tol * b.abs().max(), dtype


def test_tied_index_scores_select_what_the_torch_path_selects(monkeypatch):
    """All index head weights zero: every key scores 0, the k-th score is tied beyond the places left, and the
    choice among tied keys is torch.topk's on both paths."""
    m = _model("tiny")
    with torch.no_grad():
        for layer in m.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.weights_proj.weight.zero_()
    (a, _), (b, _), used = _both_paths(monkeypatch, m, torch.arange(3, 15)[None], 3)
    assert used == 3 and (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("weights,heads,first_zeros", [("zero", 4, True), ("negative", 4, True),
                                                       ("negative", 16, False)])
def test_rows_without_a_positive_head_weight_select_what_torch_topk_selects(monkeypatch, weights, heads,
                                                                            first_zeros):
    """Every index head weight <= 0 (zero; or negative: each token's embedding carries a large positive first
    coordinate that weights_proj maps to -1 per head and the index keys ignore): every score is <= 0, and past
    64 x index_topk keys the scan stops at the first k keys scoring exactly 0 (about 1 key in 16 with 4 heads),
    the keys torch.topk keeps; with 16 heads hardly any key scores 0, every key is scored and the top-k is the
    usual one. Either way: the torch path's logits."""
    m = _model("tiny", index_topk=4, index_n_heads=heads)
    with torch.no_grad():
        if weights == "negative":
            m.model.embed_tokens.weight[:, 0] = 20.0
        for layer in m.model.layers:
            if layer.self_attn.indexer is not None:
                w = layer.self_attn.indexer.weights_proj.weight
                w.zero_()
                if weights == "negative":
                    w[:, 0] = -1.0
                    layer.self_attn.indexer.wk.weight[:, 0] = 0.0  # keys that do not all point one way
    prompt = torch.randint(3, m.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(6))
    before = decode_kernels().path_selections(1)
    (a, _), (b, _), used = _both_paths(monkeypatch, m, prompt, steps=3)
    assert used == 3 and (decode_kernels().path_selections(1) > before) == first_zeros
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("heads,dim", [(4, 16), (4, 32), (32, 16), (2, 48), (3, 16)])
def test_index_scan_shapes_and_long_rows_select_what_the_torch_path_selects(monkeypatch, heads, dim):
    """The indexer scan's shape-specialised copies (4 x 16, 4 x 32), its per-key form (32 heads), its runtime-shape
    form (2 x 48) and the one-key-at-a-time form (3 heads), over a 300-key row: past 32 x index_topk, so the
    top-k selects among the scores above a sampled bound, with a partial last block of 16 keys."""
    m = _model("tiny", index_n_heads=heads, index_head_dim=dim)
    prompt = torch.randint(3, m.config.vocab_size, (1, 291), generator=torch.Generator().manual_seed(2))
    (a, cache_a), (b, cache_b), used = _both_paths(monkeypatch, m, prompt, steps=3)
    assert used == 3 and (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.needs_native("vnni")
@pytest.mark.parametrize("dtype,topk", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 2)])
def test_long_rows_select_through_the_key_shadow(monkeypatch, dtype, topk):
    """Past 32 x index_topk keys the scan reads the int8 shadow and rescores only the keys it cannot rule out: the
    selection (hence every logit) is the torch path's, and the shadow the C step wrote for its new keys is the one
    `KeyShadow.write` (the torch path's writer) makes of those keys. (top-2 of 400 keys: the k-th best lower bound
    is bracketed from the maxima of groups of 3 blocks of 16.)"""
    m = _model("tiny", dtype, index_topk=topk)
    prompt = torch.randint(3, m.config.vocab_size, (2, 400), generator=torch.Generator().manual_seed(4))
    before = decode_kernels().path_selections(0)
    (a, _), (b, _), used = _both_paths(monkeypatch, m, prompt, steps=3)
    assert used == 3 and decode_kernels().path_selections(0) > before
    assert (a - b).abs().max() <= (1e-5 if dtype == torch.float32 else 0.02) * b.abs().max()
    cache = DynamicCache()
    with torch.no_grad():
        m(prompt, cache=cache)
        m(torch.tensor([[7], [9]]), cache=cache)  # native: writes slot 400 of each row's shadow in C
    buf = next(buf for buf in cache._buffers[0] if isinstance(buf, _IndexKeyBuffer))
    written, cap = buf.shadow, buf.data.shape[1]
    rewritten = KeyShadow(2 * cap, buf.widths[0])
    slots = torch.tensor([400, cap + 400])
    rewritten.write(slots, buf.data.reshape(2 * cap, -1)[slots])
    blocks = slots // 16
    assert torch.equal(written.codes[blocks], rewritten.codes[blocks])
    assert torch.equal(written.scale[slots], rewritten.scale[slots]) and written.codes[blocks].abs().sum() > 0


def test_bf16_models_cache_bf16_index_keys(monkeypatch):
    """A bf16 model's indexer keys are bf16 values: the cache holds them in bf16 (half the bytes every decode step
    scans), on the native path as on the torch path."""
    (_, cache_a), (_, cache_b), used = _both_paths(monkeypatch, _model("tiny", torch.bfloat16),
                                                   torch.arange(3, 40)[None], 3)
    assert used == 3
    for cache in (cache_a, cache_b):
        assert cache[0]["index_k"].dtype == torch.bfloat16
    assert torch.equal(cache_a[0]["index_k"], cache_b[0]["index_k"])


def test_native_decode_follows_weight_updates(monkeypatch):
    spy = Spy(monkeypatch)
    m = _model("tiny")
    prompt = torch.arange(3, 12)[None]
    before = _decode(m, prompt, 2)[0]
    with torch.no_grad():
        m.model.layers[1].mlp.experts.down_proj.mul_(3.0)  # in place: the cached native parameters must not go stale
        m.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(m.model.layers[0].self_attn.o_proj.weight * 2)
    after = _decode(m, prompt, 2)[0]
    spy.enabled = False
    reference = _decode(m, prompt, 2)[0]
    assert spy.used == 4 and not torch.allclose(before, after)
    assert (after - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_forward_hooks_take_the_torch_path(monkeypatch):
    """Hooks (tensor-parallel all-reduces, user probes) need the module calls: the native path steps aside."""
    spy = Spy(monkeypatch)
    m = _model("tiny")
    seen = []
    m.model.layers[2].mlp.register_forward_hook(lambda mod, args, out: seen.append(out[0].shape))
    _decode(m, torch.arange(3, 12)[None], 2)
    assert spy.used == 0 and len(seen) == 3  # the prompt and both decode steps ran the hooked module


def test_padded_batches_and_training_take_the_torch_path(monkeypatch):
    spy = Spy(monkeypatch)
    m = _model("tiny")
    cache = DynamicCache()
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with torch.no_grad():
        m(torch.tensor([[0, 5, 6], [4, 5, 6]]), attention_mask=mask, cache=cache)
        m(torch.tensor([[7], [7]]), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
          cache=cache)
    m(torch.tensor([[7]]), cache=DynamicCache()).logits.sum().backward()  # autograd on
    assert spy.used == 0


def test_widths_beyond_the_native_buffers_take_the_torch_path(monkeypatch):
    """The native step keeps per-row buffers of the config's widths on the C stack: a checkpoint whose widths pass
    the limit (here lowered to the tiny preset's hidden size) decodes on the torch path instead of overflowing it."""
    import openglm.model.glm5.decode_step as decode_step

    limits = decode_step.decode_limits()
    monkeypatch.setattr(decode_step, "decode_limits", lambda: replace(limits, step_max_width=63))  # tiny: hidden 64
    m = _model("tiny")
    spy = Spy(monkeypatch)
    reference = _decode(m, torch.arange(3, 12)[None], 2)[0]
    assert spy.used == 0 and torch.isfinite(reference).all()
    monkeypatch.setattr(decode_step, "decode_limits", lambda: replace(limits, step_max_width=64))
    m = _model("tiny")  # the same weights, built anew under the limit that fits
    assert (_decode(m, torch.arange(3, 12)[None], 2)[0] - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert spy.used == 2
