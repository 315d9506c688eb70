"""The model's one DSA path (`sparse_dsa`) in the model: equal to dense attention where the top-k covers
every key, the same on the native and the torch-op path, and trainable (gradients equal references)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.glm5 import sparse_dsa
from openglm.model.glm5.sparse_dsa import dsa_attention, indexer_topk

TOL = 1e-4


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Weights large enough that attention patterns are not flat."""
    torch.manual_seed(seed)
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.15)


def pair(**overrides):
    """(DSA model, the same weights with dense causal attention); index_topk above every test length."""
    cfg = ModelConfig.from_preset("tiny", index_topk=64, index_n_heads=8, **overrides)
    dsa = GlmMoeDsaForCausalLM(cfg)
    randomize(dsa, seed=3)
    dense = GlmMoeDsaForCausalLM(cfg.replace(attention_kinds=["dense"] * cfg.num_hidden_layers))
    missing, unexpected = dense.load_state_dict(dsa.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in k for k in unexpected)
    return dsa, dense


def lm_loss(model, ids, mask):
    logits = model(ids, attention_mask=mask).logits
    target = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)  # real token -> real token
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("left", [True, False])
def test_topk_covering_every_key_equals_dense_attention(left, padded_batch):
    dsa, dense = pair()
    ids, mask, _ = padded_batch(dsa.config.vocab_size, [30, 19, 11], left=left, seed=4)
    with torch.no_grad():
        a, b = dsa(ids, attention_mask=mask).logits, dense(ids, attention_mask=mask).logits
    assert b.abs().max() > 1.0
    assert (a - b).abs()[mask.bool()].max() <= TOL


def test_prefill_selecting_every_key_runs_latent_attention_equal_to_dense_with_and_without_a_cache(monkeypatch):
    """No padding and at most index_topk keys: DSA is causal attention, run by `attend_latent` (own and 'shared'
    layers alike), in one prefill and in a chunked prefill on a cache."""
    from openglm.model import DynamicCache
    from openglm.model.glm5 import mla

    calls = []
    real = mla.attend_latent
    monkeypatch.setattr(mla, "attend_latent", lambda *a, **k: calls.append(1) or real(*a, **k))
    dsa, dense = pair()
    ids = torch.randint(3, dsa.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full, ref = dsa(ids).logits, dense(ids).logits
        cache = DynamicCache()
        dsa(ids[:, :10], cache=cache)
        rest = dsa(ids[:, 10:], cache=cache).logits
    assert len(calls) == 3 * dsa.config.num_hidden_layers  # three forwards, every layer
    assert ref.abs().max() > 1.0
    assert (full - ref).abs().max() <= TOL
    assert (rest - ref[:, 10:]).abs().max() <= TOL


def test_training_step_gradients_equal_the_dense_model_when_topk_covers_every_key(padded_batch):
    dsa, dense = pair()
    ids, mask, _ = padded_batch(dsa.config.vocab_size, [24, 15], seed=5)
    la, lb = lm_loss(dsa.train(), ids, mask), lm_loss(dense.train(), ids, mask)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-5 * abs(lb.item())
    ref = dict(dense.named_parameters())
    compared = 0
    for name, p in dsa.named_parameters():
        if ".indexer." in name:  # the selection is not differentiable: the indexer gets no gradient
            assert p.grad is None
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        scale = ref[name].grad.abs().max().clamp(min=1e-6)
        assert (p.grad - ref[name].grad).abs().max() <= 1e-4 * scale, name
        compared += 1
    assert compared > 20


def test_dsa_gradients_equal_the_dense_mask_reference_when_the_top_k_selects():
    """Autograd through dsa_attention (the trainer's path) in the model's MLA form: one key head whose first
    channels are the values (a view), left padding; output and the gradients of q and k equal the dense-mask
    formulation over the same selected keys."""
    g = torch.Generator().manual_seed(6)
    b, h, t, d, dv, hi, di, topk = 2, 4, 40, 12, 8, 4, 8, 7
    q = torch.randn(b, t, h, d, generator=g).requires_grad_()  # the model's layout, passed transposed
    k = torch.randn(b, t, 1, d, generator=g).requires_grad_()
    iq, ik = torch.randn(b, t, hi, di, generator=g) + 0.5, torch.randn(b, t, di, generator=g) + 0.5
    w = torch.rand(b, t, hi, generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :9] = False
    kt = k.transpose(1, 2)
    out = dsa_attention(q.transpose(1, 2), kt, kt[..., :dv], iq, ik, w, topk, scale=0.3, key_mask=mask)
    with torch.no_grad():
        slots = indexer_topk(iq, ik, w, topk, key_mask=mask)
    allow = torch.zeros(b, t, t + 1, dtype=torch.bool).scatter_(-1, slots.clamp(min=-1) % (t + 1), True)[..., :t]
    allow &= (slots >= 0).any(-1, keepdim=True)
    assert (allow.sum(-1)[:, topk:] == topk).any() and allow[1, :9].sum() == 0  # selects; padding sees nothing
    s = torch.einsum("bthd,bnd->bhtn", q, k[:, :, 0]) * 0.3
    p = torch.softmax(s.masked_fill(~allow[:, None], float("-inf")), -1).nan_to_num(0.0)
    ref = torch.einsum("bhtn,bnd->bhtd", p, k[:, :, 0, :dv])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn(ref.shape, generator=g)
    gq, gk = torch.autograd.grad((out * cot).sum(), (q, k))
    rq, rk = torch.autograd.grad((ref * cot).sum(), (q, k))
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all() and gk.abs().sum() > 0
    torch.testing.assert_close(gq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gk, rk, atol=1e-5, rtol=1e-5)


def test_model_on_the_torch_op_path_equals_the_native_path(monkeypatch, padded_batch):
    """Without the native kernels (no compiler, OPENGLM_NATIVE=0) the same module's torch ops run: same logits
    for a selecting prefill (more queries than a decode block) and the decode steps after it."""
    from openglm.model import DynamicCache

    cfg = ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=16)
    m = GlmMoeDsaForCausalLM(cfg).eval()
    randomize(m, seed=7)
    ids, mask, _ = padded_batch(cfg.vocab_size, [36, 28], seed=8)

    def run():
        cache = DynamicCache()
        with torch.no_grad():
            out = [m(ids[:, :32], attention_mask=mask[:, :32], cache=cache).logits]
            for i in range(32, 36):
                out.append(m(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache).logits)
        return torch.cat(out, 1)

    native = run()
    monkeypatch.setattr(sparse_dsa, "dsa_kernels", lambda: None)
    ops = run()
    assert (native - ops).abs()[mask.bool()].max() <= TOL
