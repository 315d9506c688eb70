"""Kimi Delta Attention (glm5_next's linear-attention layer): the chunked form equals the recurrent one (values and
gradients), both equal transformers' reference functions, and the layer's state carries a sequence across calls."""

from __future__ import annotations

import pytest
import torch

from openglm.model import ModelConfig
from openglm.model.glm5_next.kda import LinearAttention, kda_chunked, kda_recurrent, l2_normalize


def inputs(B=2, T=150, H=3, dk=16, dv=8, gate="bounded", seed=0, state=True):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, dk, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(B, T, H, dk, generator=g))
    v = torch.randn(B, T, H, dv, generator=g)
    z = torch.randn(B, T, H, dk, generator=g) * 2
    # bounded: transformers' default gate, in (-5, 0); steep: softplus gates down to ~ -40 per step, whose running
    # sums over a 64-token chunk would overflow exp() if the chunked form factored exp(G_r - G_s)
    gates = {"bounded": -5 * torch.sigmoid(z), "steep": -torch.nn.functional.softplus(4 * z + 2)}[gate]
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    S0 = torch.randn(B, H, dk, dv, generator=g) * 0.5 if state else None
    return q, k, v, gates, beta, S0


@pytest.mark.parametrize("gate", ["bounded", "steep"])
@pytest.mark.parametrize("T", [1, 37, 64, 150])
def test_chunked_equals_recurrent(T, gate):
    q, k, v, g, beta, S0 = inputs(T=T, gate=gate)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, S0)
    assert o_r.abs().max() > 0.1
    assert (o_r - o_c).abs().max() <= 1e-5
    assert (S_r - S_c).abs().max() <= 1e-5


def test_chunked_gradients_equal_recurrent_ones():
    """Training runs the chunked form under autograd: its gradients are the recurrence's."""
    leaves = [t.double().requires_grad_() for t in inputs(T=70, seed=1)]
    grads = []
    for fn in (kda_recurrent, kda_chunked):
        o, S = fn(*leaves)
        g = torch.autograd.grad((o.sin().sum() + S.cos().sum()), leaves)
        grads.append(g)
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-8 * max(1.0, a.abs().max().item())


def test_both_forms_equal_transformers_reference_functions():
    from transformers.models.glm5_next.modeling_glm5_next import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    g = torch.Generator().manual_seed(2)
    B, T, H, d = 2, 70, 2, 16
    q, k, v = (torch.randn(B, T, H, d, generator=g) for _ in range(3))
    gates = -5 * torch.sigmoid(torch.randn(B, T, H, d, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    S0 = torch.randn(B, H, d, d, generator=g)
    ref_c, ref_S = chunk_kimi_delta_attention(q, k, v, gates, beta, initial_state=S0.clone(), output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    ref_r, _ = recurrent_kimi_delta_attention(q[:, :1], k[:, :1], v[:, :1], gates[:, :1], beta[:, :1], S0.clone(),
                                              True, use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q) * d ** -0.5, l2_normalize(k)
    o, S = kda_chunked(qn, kn, v, gates, beta, S0)
    assert (o - ref_c).abs().max() <= 1e-5 and (S - ref_S).abs().max() <= 1e-5
    o1, _ = kda_recurrent(qn[:, :1], kn[:, :1], v[:, :1], gates[:, :1], beta[:, :1], S0)
    assert (o1 - ref_r).abs().max() <= 1e-5


def test_layer_state_carries_a_sequence_across_calls_and_padding_leaves_it_unchanged():
    """One call over 90 tokens = 50 tokens, then 3 decode-sized steps, then 37 (the conv window and the recurrent
    state are handed over explicitly); left padding before a sequence does not change its outputs."""
    cfg = ModelConfig.from_preset("tiny-glm5-next")
    torch.manual_seed(3)
    layer = LinearAttention(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        x = torch.randn(2, 90, cfg.hidden_size)
        full, end = layer(x, return_state=True)
        state, outs = None, []
        for a, b in ((0, 50), (50, 51), (51, 52), (52, 53), (53, 90)):
            out, state = layer(x[:, a:b], state, return_state=True)
            outs.append(out)
        assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5
        assert (state.recurrent - end.recurrent).abs().max() <= 1e-5 and torch.equal(state.conv, end.conv)
        padded = torch.cat([torch.randn(2, 7, cfg.hidden_size), x], 1)
        valid = torch.ones(2, 97, dtype=torch.bool)
        valid[:, :7] = False
        out, st = layer(padded, token_valid=valid, return_state=True)
        assert (out[:, 7:] - full).abs().max() <= 1e-5 and (st.recurrent - end.recurrent).abs().max() <= 1e-5
        assert end.recurrent.shape == (2, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim)
        assert end.conv.shape == (2, 3 * cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_conv_kernel_dim - 1)
