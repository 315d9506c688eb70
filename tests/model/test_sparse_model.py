"""The sparse attention kinds inside the GLM-5 model (MLA in absorbed form, with the KV cache)."""
import pytest
import torch

from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig

TOL = 1e-4
# Windows far below the test length, so local, global, random and padding all matter.
SMALL = dict(sliding_window=6, lgr_local_window=5, lgr_global_stride=4, lgr_random=3, lgr_seed=11,
             index_n_heads=8, index_topk=6)  # 8 index heads: no relu ties in a DSA layer's top-k


def model(kinds, **overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", attention_kinds=kinds, indexer_types=["full"] * 3,
                                  **{**SMALL, **overrides})
    m = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():  # weights large enough that attention patterns are not flat
            if p.dim() > 1:
                p.normal_(0, 0.15)
    return m


def batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1  # left padding, as the engine batches prompts
    return ids.masked_fill(mask == 0, 0), mask


KINDS = {
    "sliding_window": ["sliding_window", "dense", "sliding_window"],
    "local_global_random": ["local_global_random", "local_global_random", "dense"],
    "mixed": ["local_global_random", "dsa", "sliding_window"],
}


@pytest.mark.parametrize("name", list(KINDS))
def test_prefill_then_decode_equals_full_forward(name):
    m = model(KINDS[name])
    ids, mask = batch(m.config.vocab_size, [30, 22, 13])
    with torch.no_grad():
        full = m(ids, attention_mask=mask).logits
        cache = DynamicCache()
        steps = [m(ids[:, :12], attention_mask=mask[:, :12], cache=cache).logits]
        for t in range(12, 30):
            steps.append(m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits)
    err = (full - torch.cat(steps, 1)).abs()[mask.bool()].max()
    assert err <= TOL, f"{name}: prefill+decode differs from the full forward by {err}"


@pytest.mark.parametrize("name", ["sliding_window", "local_global_random"])
def test_padded_row_equals_sequence_alone(name):
    m = model(KINDS[name])
    ids, mask = batch(m.config.vocab_size, [30, 19], seed=1)
    with torch.no_grad():
        together = m(ids, attention_mask=mask).logits
        alone = m(ids[1:, 11:]).logits
    assert (together[1, 11:] - alone[0]).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["sliding_window", "local_global_random"])
def test_wide_window_equals_dense_and_narrow_one_does_not(kind):
    """With a window covering the whole sequence both kinds are dense causal attention (the model's own
    fused-SDPA path is the reference); with the small window they must differ from it."""
    ids, _ = batch(256, [28], seed=2)
    dense = model(["dense"] * 3)
    with torch.no_grad():
        ref = dense(ids).logits
        wide = model([kind] * 3, sliding_window=64, lgr_local_window=64)(ids).logits
        narrow = model([kind] * 3)(ids).logits
    assert (wide - ref).abs().max() <= TOL
    assert (narrow - ref).abs().max() > 1e-2


def test_lgr_layers_train():
    m = model(KINDS["local_global_random"]).train()
    ids, mask = batch(m.config.vocab_size, [24, 17], seed=3)
    logits = m(ids, attention_mask=mask).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in m.model.layers[0].self_attn.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
