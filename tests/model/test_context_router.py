"""The context-aware router (`router_context="gated"`): causal, the same function with and without a cache (padding,
chunks, the window's edge), exactly the standard router while untrained, saved and loaded with its documented names,
and off by default."""

from __future__ import annotations

import json

import pytest
import torch

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, load_model, save_pretrained
from openglm.model.cache import DynamicCache
from openglm.model.context_router import ContextRouter, windowed_summary
from openglm.model.errors import ConfigError
from openglm.model.glm5.decode_step import DecodePlan


def context_model(seed=0, scale=2.0, **overrides) -> GlmMoeDsaForCausalLM:
    """A tiny context-router model whose context weights are large enough to change the routing. 16 indexer heads:
    with the preset's 4, DSA's exact ties at a zero score make chunked and whole forwards select differently."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", router_context="gated",
                                  **{"router_context_window": 8, "index_n_heads": 16, **overrides})
    model = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for router in routers(model):
            router.context_weight.normal_(0.0, scale)
    return model


def routers(model) -> list[ContextRouter]:
    layers = list(model.model.layers) + list(model.model.mtp_layers)
    return [layer.mlp.gate for layer in layers if isinstance(getattr(layer.mlp, "gate", None), ContextRouter)]


def chosen_experts(model, ids, **kw) -> list[torch.Tensor]:
    """Each MoE layer's top-k expert indices per token, sorted."""
    got = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: got.append(out.indices.sort(-1).values))
             for r in routers(model)]
    try:
        with torch.no_grad():
            model(ids, **kw)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_the_context_changes_the_routing():
    """Guards the other tests: with these weights the summary decides experts, so 'unchanged' means something."""
    model = context_model()
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with_context = chosen_experts(model, ids)
    with torch.no_grad():
        for router in routers(model):
            router.context_weight.zero_()
    without = chosen_experts(model, ids)
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(with_context, without))
    assert changed >= 10, changed


def test_logits_at_t_do_not_depend_on_later_tokens():
    model = context_model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=g)
    other = ids.clone()
    other[:, 17:] = torch.randint(3, model.config.vocab_size, (2, 13), generator=g)
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    torch.testing.assert_close(a[:, :17], b[:, :17], atol=1e-5, rtol=0)
    assert (a[:, 17:] - b[:, 17:]).abs().max() > 1e-2
    routes_a, routes_b = chosen_experts(model, ids), chosen_experts(model, other)
    assert all(torch.equal(x.view(2, 30, -1)[:, :17], y.view(2, 30, -1)[:, :17]) for x, y in zip(routes_a, routes_b))


@pytest.mark.parametrize("chunks", [(40,), (13, 1, 1, 9, 16), (1,) * 40], ids=["one", "mixed", "token-by-token"])
def test_cached_steps_equal_the_full_forward(chunks):
    """Prefill then decode through the cache: the state is the per-token entries, recomputed over the window (8 here,
    so 40 tokens cross its edge many times)."""
    model = context_model()
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache, start, parts = DynamicCache(), 0, []
        for n in chunks:
            parts.append(model(ids[:, start:start + n], cache=cache).logits)
            start += n
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


def test_left_padding_leaves_no_trace():
    model = context_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.full((1, 5), 7), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = model(ids).logits
        cache = DynamicCache()
        first = model(padded[:, :15], attention_mask=mask[:, :15], cache=cache).logits
        rest = model(padded[:, 15:], attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(torch.cat([first, rest], 1)[:, 5:], alone, atol=1e-5, rtol=0)


def test_windowed_summary_equals_its_definition():
    """The batched Toeplitz form against the recurrence c_t = r c_(t-1) + (1 - r) u_t (a window longer than the
    sequence) and against the windowed sum written out; a step with tokens past reads the same."""
    g = torch.Generator().manual_seed(5)
    heads, d, T = 2, 6, 23
    rho = torch.randn(heads, generator=g)
    u = torch.randn(1, T, d, generator=g)
    r = rho.sigmoid().repeat_interleave(d // heads)
    state, recurrent = torch.zeros(d), []
    for t in range(T):
        state = r * state + (1 - r) * u[0, t]
        recurrent.append(state)
    torch.testing.assert_close(windowed_summary(u, 0, 64, rho)[0], torch.stack(recurrent), atol=1e-6, rtol=1e-5)
    window = 7
    got = windowed_summary(u, 0, window, rho)
    for t in range(T):
        want = sum((1 - r) * r ** (t - s) * u[0, s] for s in range(max(0, t - window + 1), t + 1))
        torch.testing.assert_close(got[0, t], want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(windowed_summary(u, 15, window, rho), got[:, 15:], atol=1e-6, rtol=0)


def test_untrained_context_router_is_the_standard_router():
    """Same seed: the context model draws every shared weight as the standard one, and with U = 0 its logits are
    the standard model's; only the four documented tensors per MoE layer are added."""
    torch.manual_seed(11)
    standard = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")).eval()
    torch.manual_seed(11)
    gated = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", router_context="gated")).eval()
    a, b = standard.state_dict(), gated.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    extra = sorted(set(b) - set(a))
    assert extra == [f"model.layers.{i}.mlp.gate.{n}" for i in (1, 2)
                     for n in ("context_decay", "context_proj.bias", "context_proj.weight", "context_weight")]
    ids = torch.randint(3, 384, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(gated(ids).logits, standard(ids).logits, atol=1e-6, rtol=0)


def test_checkpoint_round_trip_with_next_n_layer(tmp_path):
    model = context_model(num_nextn_predict_layers=1)
    save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["openglm"]["router_context"] == "gated" and saved["openglm"]["router_context_window"] == 8
    assert "router_context" not in saved  # transformers' keys are those of a standard GLM config
    loaded = load_model(str(tmp_path), dtype=torch.float32)
    assert len(routers(loaded)) == 3  # two MoE layers and the next-n layer
    ids = torch.randint(3, 384, (2, 15), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_off_by_default_and_checked():
    cfg = ModelConfig.from_preset("tiny")
    assert cfg.router_context == "none" and cfg.to_hf_dict()["openglm"]["router_context"] == "none"
    assert not any("context" in n for n in GlmMoeDsaForCausalLM(cfg).state_dict())
    with pytest.raises(ConfigError, match="router_context='pooled'"):
        ModelConfig.from_preset("tiny", router_context="pooled")
    with pytest.raises(ConfigError, match="router_context_dim=30"):
        ModelConfig.from_preset("tiny", router_context="gated", router_context_dim=30)
    with pytest.raises(ConfigError, match="router_context_window=0"):
        ModelConfig.from_preset("tiny", router_context="gated", router_context_window=0)


def test_decode_takes_the_torch_path():
    """The native decode step routes in C from the hidden state alone: a context model never reaches it."""
    model = context_model()
    ids = torch.randint(3, 384, (1, 6))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache)
        assert DecodePlan.create(model.model.layers, cache, ids[:, :1], None, torch.float32) is None


def test_gradients_reach_the_context_parameters():
    model = context_model().train()
    ids = torch.randint(3, 384, (2, 16))
    out = model(ids, aux=True)
    (out.logits.logsumexp(-1).mean() + out.aux.aux_loss).backward()
    for router in routers(model):
        assert router.context_weight.grad.abs().sum() > 0
        assert router.context_proj.weight.grad.abs().sum() > 0
