"""Training a glm5_next model (KDA layers in their chunked form under autograd, pooled DSA, hyper-connections):
the loss falls, a resumed run is the uninterrupted one, and activation checkpointing keeps the gradients."""

from __future__ import annotations

import torch

from openglm.model.glm5_next import Glm5NextForCausalLM
from openglm.train.activations import enable_activation_checkpointing
from openglm.train.trainer import train


def test_tiny_glm5_next_learns_and_resumes_exactly(tiny_cfg, tmp_path):
    cfg = dict(preset="tiny-glm5-next", seq_len=72, max_steps=12, save_every=100, eval_every=6)  # 72 > a KDA chunk
    full = train(tiny_cfg(out_dir=str(tmp_path / "full"), **cfg))
    assert isinstance(full.model, Glm5NextForCausalLM)
    first, last = sum(full.losses[s] for s in (1, 2, 3)) / 3, sum(full.losses[s] for s in (10, 11, 12)) / 3
    assert last < first - 1.0, (first, last)
    assert full.val_losses[12] < full.val_losses[6]
    part = tiny_cfg(out_dir=str(tmp_path / "part"), **cfg)
    assert train(part, stop_at=5).step == 5
    second = train(part, resume=True)
    for step in range(6, 13):
        assert abs(second.losses[step] - full.losses[step]) <= 1e-6, step
    a, b = full.model.state_dict(), second.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_activation_checkpointing_gives_the_same_gradients():
    from openglm.model import ModelConfig

    torch.manual_seed(0)
    plain = Glm5NextForCausalLM(ModelConfig.from_preset("tiny-glm5-next")).train()
    checked = Glm5NextForCausalLM(plain.config).train()
    checked.load_state_dict(plain.state_dict())
    assert enable_activation_checkpointing(checked, 2) == 3
    vocab = plain.config.vocab_size
    ids = torch.randint(0, vocab, (2, 40))
    for m in (plain, checked):
        out = m(ids[:, :-1], aux=True)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        (loss + out.aux.aux_loss).backward()
    grads = dict(plain.named_parameters())
    for name, p in checked.named_parameters():
        ref = grads[name].grad
        assert (p.grad is None) == (ref is None), name
        if ref is not None:
            assert (p.grad - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), name
