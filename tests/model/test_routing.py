"""Routing options of the MoE layer on hand-computable cases: losses, group limits, capacity dropping."""

from __future__ import annotations

import math

import pytest
import torch

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig
from openglm.model.moe import MoE
from openglm.model.router import Routing, balance_losses, cv_squared


def _cfg(**kw):
    base = dict(hidden_size=4, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
                moe_intermediate_size=3, n_shared_experts=0, routed_scaling_factor=1.0, norm_topk_prob=False,
                router="softmax")
    return ModelConfig.from_preset("tiny", **{**base, **kw})


def _moe(cfg, router_weight):
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.tensor(router_weight, dtype=torch.float32))
        moe.experts.gate_up_proj.normal_()
        moe.experts.down_proj.normal_()
    return moe


def test_cv_squared_by_hand():
    assert cv_squared(torch.tensor([1.5, 0.0])).item() == pytest.approx(1.0)  # var 0.5625 / mean^2 0.5625
    assert cv_squared(torch.tensor([2.0, 2.0, 2.0])).item() == pytest.approx(0.0)


def test_each_loss_by_hand():
    """Two tokens, both with logits [ln 3, 0] -> softmax [0.75, 0.25], both routed to expert 0 (k=1)."""
    logits = torch.tensor([[math.log(3), 0.0]] * 2)
    r = Routing(logits, logits.softmax(-1), torch.tensor([[0], [0]]), torch.tensor([[0.75], [0.75]]))
    losses = balance_losses(r, n_experts=2)
    assert losses["cv_importance"].item() == pytest.approx(1.0)  # importance [1.5, 0]
    assert losses["cv_load"].item() == pytest.approx(0.25)  # load [1.5, 0.5]: var 0.25 / mean^2 1
    assert losses["switch"].item() == pytest.approx(1.5)  # 2 * (f=[1,0] . P=[0.75,0.25])
    assert losses["z"].item() == pytest.approx(math.log(4) ** 2)  # logsumexp = ln 4
    uniform = Routing(torch.zeros(2, 2), torch.full((2, 2), 0.5), torch.tensor([[0], [1]]), torch.full((2, 1), 0.5))
    assert balance_losses(uniform, 2)["switch"].item() == pytest.approx(1.0)  # perfectly balanced -> 1


def test_losses_skip_padding_tokens():
    logits = torch.tensor([[math.log(3), 0.0], [0.0, 5.0]])
    r = Routing(logits, logits.softmax(-1), torch.tensor([[0], [1]]), torch.tensor([[0.75], [0.9]]))
    masked = balance_losses(r, 2, token_mask=torch.tensor([True, False]))
    assert masked["z"].item() == pytest.approx(math.log(4) ** 2)
    assert masked["switch"].item() == pytest.approx(2 * 0.75)


def test_model_aux_loss_weights_the_components_and_backpropagates():
    cfg = ModelConfig.from_preset("tiny", router="softmax", cv_loss_coef=0.5, switch_loss_coef=0.1, z_loss_coef=0.01)
    m = GlmMoeDsaForCausalLM(cfg)
    ids = torch.randint(3, cfg.vocab_size, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    aux = m(ids, attention_mask=mask, aux=True).aux
    L = aux.losses
    expected = 0.5 * (L["cv_importance"] + L["cv_load"]) + 0.1 * L["switch"] + 0.01 * L["z"]
    assert aux.aux_loss.item() == pytest.approx(expected.item())
    assert aux.expert_counts.shape == (2, cfg.n_routed_experts)
    assert aux.expert_counts.sum(1).tolist() == [16 * 2, 16 * 2]  # 16 real tokens x top-2, per MoE layer
    assert aux.dropped_fraction == 0.0
    aux.aux_loss.backward()
    assert m.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_softmax_top_k_gating():
    cfg = _cfg(n_routed_experts=4, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.0)
    moe = _moe(cfg, [[1.0, 0, 0, 0], [3.0, 0, 0, 0], [2.0, 0, 0, 0], [0.0, 0, 0, 0]])
    r = moe.gate(torch.tensor([[1.0, 0, 0, 0]]))
    assert sorted(r.indices[0].tolist()) == [1, 2]
    p1, p2 = math.exp(3) / (math.exp(3) + math.exp(2)), math.exp(2) / (math.exp(3) + math.exp(2))
    assert sorted(r.weights[0].tolist()) == pytest.approx(sorted([2 * p1, 2 * p2]))


def test_sigmoid_group_limited_choice_and_bias_used_for_choice_only():
    cfg = _cfg(router="sigmoid", n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1)
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    s = [0.9, 0.1, 0.6, 0.6]  # group 0 holds the best expert, but group 1's top-2 sum (1.2) beats 1.0
    moe = _moe(cfg, [[logit(v), 0, 0, 0] for v in s])
    x = torch.tensor([[1.0, 0, 0, 0]])
    r = moe.gate(x)
    assert sorted(r.indices[0].tolist()) == [2, 3]
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    r = moe.gate(x)
    assert sorted(r.indices[0].tolist()) == [0, 1]
    assert sorted(r.weights[0].tolist()) == pytest.approx([0.1, 0.9])  # unbiased scores as gates


def _expert(moe, e, x):
    inter = moe.experts.down_proj.shape[-1]
    w = moe.experts.gate_up_proj[e]
    h = torch.nn.functional.silu(x @ w[:inter].T) * (x @ w[inter:].T)
    return h @ moe.experts.down_proj[e].T


def test_grouped_experts_equal_a_per_token_reference():
    cfg = _cfg(n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1)
    moe = _moe(cfg, torch.randn(6, 4).tolist())
    x = torch.randn(2, 7, 4)
    with torch.no_grad():
        out, _ = moe(x)
        flat = x.reshape(-1, 4)
        r = moe.gate(flat)
        ref = torch.stack([sum(r.weights[t, j] * _expert(moe, int(r.indices[t, j]), flat[t]) for j in range(2))
                           for t in range(flat.shape[0])]) + moe.shared_experts(flat)
    assert torch.allclose(out.reshape(-1, 4), ref, atol=1e-5)


def test_capacity_drops_tokens_past_the_limit_in_token_order():
    cfg = _cfg(capacity_factor=1.0)  # 4 tokens x top-1 / 2 experts -> capacity 2
    moe = _moe(cfg, [[5.0, 0, 0, 0], [0.0, 0, 0, 0]])  # every token prefers expert 0
    x = torch.tensor([[1.0, 0.1, 0.2, 0.3], [1.0, 0.4, 0.5, 0.6], [1.0, 0.7, 0.8, 0.9], [1.0, 1.0, 1.1, 1.2]])
    with torch.no_grad():
        out, stats = moe(x[None], with_stats=True)
        w = moe.gate(x).weights[:, 0]
    out = out[0]
    assert moe.capacity(4) == 2
    for t in (0, 1):
        assert torch.allclose(out[t], w[t] * _expert(moe, 0, x[t]), atol=1e-6)
    assert torch.equal(out[2:], torch.zeros(2, 4))  # dropped: only the residual path carries them
    assert stats.dropped == 2 and stats.assigned == 4
    assert stats.counts.tolist() == [4, 0]  # counts are routing decisions, before dropping


def test_model_reports_dropped_fraction():
    cfg = ModelConfig.from_preset("tiny", capacity_factor=0.5)
    m = GlmMoeDsaForCausalLM(cfg)
    aux = m(torch.randint(3, cfg.vocab_size, (2, 16)), aux=True).aux
    assert 0.5 <= aux.dropped_fraction < 1.0  # capacity covers at most half the assignments


def test_inference_expert_path_equals_the_autograd_path_in_fp32_and_bf16():
    """No-grad forwards take a leaner expert loop (and, in bf16, ATen's gemm for experts with few rows);
    both must give what the differentiable loop gives. 40 tokens over 6 experts mixes few-row and
    many-row experts."""
    cfg = _cfg(n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, router="sigmoid")
    moe = _moe(cfg, torch.randn(6, 4).tolist())
    for n_tokens in (3, 40):
        x = torch.randn(1, n_tokens, 4)
        trained = moe(x)[0].detach()
        with torch.no_grad():
            inferred = moe(x)[0]
            counts = torch.bincount(moe.gate(x[0]).indices.reshape(-1), minlength=6)
        assert torch.allclose(inferred, trained, atol=1e-6)
        half = MoE(cfg).to(torch.bfloat16)
        half.load_state_dict(moe.state_dict())
        with torch.no_grad():
            out16 = half(x.bfloat16())[0].float()
        assert (out16 - trained).abs().max() <= 0.05 * trained.abs().max()
        if n_tokens == 3:
            assert counts.max() <= 4  # every active expert took the few-rows path
    assert torch._C._get_mkldnn_enabled()  # the oneDNN switch is restored afterwards


def test_no_grad_under_bf16_autocast_matches_grad_enabled_forward():
    """Validation of an fp32 model under bf16 autocast runs without gradients: the expert loop must
    accept matmul outputs in autocast's dtype (a regression: it wrote them into an fp32 buffer)."""
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 48))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = model(ids).logits.detach().float()
        with torch.no_grad():
            inferred = model(ids).logits.float()
    assert torch.isfinite(inferred).all()
    assert torch.allclose(inferred, trained, atol=1e-5)
