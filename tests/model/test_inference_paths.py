"""Inference-only fast paths (`fast.Inference`: fused projections, grouped expert matmuls, the fp32 LM head, the
native kernels) equal the reference path (`fast.REFERENCE`, what training differentiates), their cached derived
weights never go stale, and `fast.choose` picks them only without autograd."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, fast
from openglm.model.derived import derived_weight, fused_rows
from openglm.model.fast import INFERENCE, REFERENCE
from openglm.model.moe import MLP, Experts
from openglm.model.native import heads_linear, swiglu_ok
from openglm.model.norm import RMSNorm

TOL = 1e-5


def _model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    m = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny", **{"index_topk": 6, **overrides})).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    return m


def _fast_and_reference(m, ids):
    """Logits with the inference paths (no autograd) and with the training path (autograd on)."""
    with torch.no_grad():
        fast = m(ids).logits
    with torch.enable_grad():
        ref = m(ids).logits.detach()
    return fast, ref


def test_fused_paths_match_the_training_path():
    m = _model()
    ids = torch.randint(3, m.config.vocab_size, (2, 20))
    fast, ref = _fast_and_reference(m, ids)
    assert (fast - ref).abs().max() <= TOL
    attn = m.model.layers[0].self_attn
    assert "input" in attn._derived_weights and "query" in attn._derived_weights  # the fused path ran


def test_fused_weights_follow_in_place_updates_and_reloads():
    m = _model()
    ids = torch.randint(3, m.config.vocab_size, (2, 20))
    with torch.no_grad():
        before = m(ids).logits
        for layer in m.model.layers:  # an optimizer-like in-place step on every fused source
            layer.self_attn.q_a_proj.weight.mul_(1.5)
            layer.self_attn.indexer.wq_b.weight.add_(0.1) if layer.self_attn.indexer is not None else None
            mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
            mlp.up_proj.weight.mul_(-1)
    fast, ref = _fast_and_reference(m, ids)
    assert (fast - before).abs().max() > 1e-2  # the update changed the output ...
    assert (fast - ref).abs().max() <= TOL  # ... and the cached fused weights followed it
    other = _model(seed=1)
    m.load_state_dict(other.state_dict())
    fast, ref = _fast_and_reference(m, ids)
    assert (fast - ref).abs().max() <= TOL
    with torch.no_grad():
        assert (fast - other(ids).logits).abs().max() <= TOL


def test_derived_weights_stay_out_of_the_state_dict_and_skip_plain_tensors():
    m = _model()
    with torch.no_grad():
        m(torch.randint(3, m.config.vocab_size, (1, 8)))
    assert not any("derived" in k for k in m.state_dict())
    assert set(m.state_dict()) == set(_model().state_dict())
    lin = torch.nn.Linear(4, 3, bias=False)
    assert fused_rows(lin, "x", [lin, lin]).shape == (6, 4)
    # a weight that is not a Parameter (the engine's quantisation dequantises per call): no caching
    assert derived_weight(lin, "y", [lin.weight.detach().clone()], lambda w: w) is None
    calls = []
    build = lambda w: calls.append(1) or w * 2  # noqa: E731
    derived_weight(lin, "z", [lin.weight], build)
    derived_weight(lin, "z", [lin.weight], build)
    assert len(calls) == 1  # cached while unchanged
    with torch.no_grad():
        lin.weight.zero_()
    assert derived_weight(lin, "z", [lin.weight], build).abs().max() == 0 and len(calls) == 2
    lin.weight.data = torch.ones(3, 4)  # new storage, same Parameter
    assert torch.equal(derived_weight(lin, "z", [lin.weight], build), torch.full((3, 4), 2.0))


def _experts(seed: int) -> Experts:
    """8 experts of hidden 64, with weights large enough that every expert's output matters."""
    torch.manual_seed(seed)
    experts = Experts(ModelConfig.from_preset("tiny", hidden_size=64, moe_intermediate_size=32, n_routed_experts=8))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts


def _loop(experts, xs, counts):
    """The per-expert matmul loop (the path for experts with many rows)."""
    out = torch.empty_like(xs)
    groups = [(e, x, y) for e, (x, y) in enumerate(zip(xs.split(counts), out.split(counts))) if len(x)]
    fast.swiglu_rows(experts, groups)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
def test_grouped_expert_matmuls_equal_the_per_expert_loop(dtype, tol, monkeypatch):
    monkeypatch.setattr("openglm.model.native.decode_kernels", lambda: None)  # as without a C compiler
    experts = _experts(0).to(dtype)
    with torch.no_grad():
        counts = [2, 0, 1, 3, 0, 0, 1, 1]
        xs = torch.randn(sum(counts), 64, dtype=dtype)
        assert fast.grouped_mm_ok(experts, dtype) and not swiglu_ok(xs, experts.gate_up_proj, experts.down_proj)
        grouped = INFERENCE.experts(experts, xs, counts)  # takes the grouped path
        loop = _loop(experts, xs, counts)
    assert grouped.dtype == dtype and (grouped.float() - loop.float()).abs().max() <= tol


def test_bf16_prefill_experts_take_the_grouped_matmul_equal_to_the_per_expert_loop(monkeypatch):
    experts = _experts(1).to(torch.bfloat16)
    calls = []
    real = fast.grouped_mm
    monkeypatch.setattr(fast, "grouped_mm", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        counts = [9, 0, 12, 5, 0, 7, 6, 10]  # every active expert has more than FEW_ROWS rows: a prefill
        xs = torch.randn(sum(counts), 64, dtype=torch.bfloat16)
        grouped = INFERENCE.experts(experts, xs, counts)
        loop = _loop(experts, xs, counts).float()
    assert calls and loop.abs().max() > 0.1
    assert (grouped.float() - loop).abs().max() <= 0.02 * loop.abs().max()


@pytest.mark.needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_expert_kernel_equals_the_per_expert_loop(dtype):
    experts = _experts(2).to(dtype)
    with torch.no_grad():
        counts = [2, 0, 1, 8, 0, 0, 1, 3]  # up to the kernel's 8 rows per expert
        xs = torch.randn(sum(counts), 64, dtype=dtype)
        reference = _loop(copy.deepcopy(experts).float(), xs.float(), counts)  # fp32 maths on the same values
        assert swiglu_ok(xs, experts.gate_up_proj, experts.down_proj)
        native = INFERENCE.experts(experts, xs, counts)
    err = (native.float() - reference).abs().max() / reference.abs().max()
    assert native.dtype == dtype and err <= (1e-6 if dtype == torch.float32 else 4e-3)  # bf16: its final rounding


def test_lm_head_few_rows_path_equals_linear():
    m = _model()
    x = torch.randn(3, 1, m.config.hidden_size)
    with torch.no_grad():
        out = m.logits(x)
    assert out.is_contiguous() and out.shape == (3, 1, m.config.vocab_size)
    assert (out - F.linear(x, m.lm_head.weight)).abs().max() <= 1e-5


def test_choose_picks_the_reference_path_under_autograd_or_autocast_and_a_plan_only_without_statistics():
    x = torch.zeros(1, 1, dtype=torch.long)
    plans = []
    with torch.enable_grad():
        assert fast.choose(x, decode_plan=lambda: plans.append(1) or "plan") is REFERENCE
    with torch.no_grad():
        assert fast.choose(x) is INFERENCE
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fast.choose(x, decode_plan=lambda: plans.append(1) or "plan") is REFERENCE
        assert fast.choose(x, stats=True, decode_plan=lambda: plans.append(1) or "plan") is INFERENCE
        assert fast.choose(x, decode_plan=lambda: None) is INFERENCE
        assert fast.choose(x, decode_plan=lambda: "plan").plan == "plan"
    assert not plans  # never built where it could not run


def test_router_without_probs_routes_the_same():
    m = _model()
    gate = m.model.layers[1].mlp.gate
    x = torch.randn(5, m.config.hidden_size)
    full, lean = gate(x), gate(x, with_probs=False)
    assert lean.probs is None and full.probs is not None
    assert torch.equal(full.indices, lean.indices) and torch.equal(full.weights, lean.weights)


def test_bf16_absorbed_products_use_an_fp32_copy_that_follows_updates():
    m = _model(attention_kinds=["dense"] * 3).to(torch.bfloat16)  # dense attention: no top-k flips between the paths
    ids = torch.randint(3, m.config.vocab_size, (2, 12))
    fast, ref = _fast_and_reference(m, ids)
    derived = m.model.layers[0].self_attn._derived_weights
    assert derived["w_uk_t_fp32"][2].dtype == derived["w_uv_fp32"][2].dtype == torch.float32
    scale = ref.float().abs().max()
    assert (fast.float() - ref.float()).abs().max() <= 0.03 * scale
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.kv_b_proj.weight.mul_(-2)
    fast, ref = _fast_and_reference(m, ids)
    assert (fast.float() - ref.float()).abs().max() <= 0.03 * ref.float().abs().max()


def test_small_batch_expert_sort_equals_the_tensor_sort(monkeypatch):
    experts = _experts(1)
    with torch.no_grad():
        x = torch.randn(6, 64)
        indices = torch.tensor([[3, 1], [1, 3], [7, 0], [3, 5], [0, 7], [1, 2]])  # repeats, both orders
        weights = torch.rand(6, 2)
        small, dropped = experts(x, indices, weights)
        monkeypatch.setattr("openglm.model.moe.SMALL_BATCH", 0)
        general, _ = experts(x, indices, weights)
    assert dropped == 0 and (small - general).abs().max() <= 1e-6


@pytest.mark.needs_native
@pytest.mark.parametrize("rows", [1, 8, 9])  # 9: past the kernel's rows, the matmul path
def test_mlp_decode_rows_equal_the_training_path(rows):
    cfg = ModelConfig.from_preset("tiny", hidden_size=64, intermediate_size=48)
    torch.manual_seed(3)
    mlp = MLP(cfg)
    x = torch.randn(rows, 1, 64)
    with torch.enable_grad():
        reference = mlp(x).detach()  # separate gate / up / down Linears
    with torch.no_grad():
        got = mlp(x)
    assert got.shape == x.shape and (got - reference).abs().max() <= 1e-6 * reference.abs().max()


def test_indexer_blocks_that_see_at_most_topk_keys_take_them_all():
    """Query blocks whose keys all fit in the top-k skip scoring; the logits equal one block over everything,
    with left padding too (fp32; the first blocks of 4 queries see <= 8 keys)."""
    chunked, whole = _model(seed=4, index_topk=8, attn_query_chunk=4), _model(seed=4, index_topk=8)
    ids = torch.randint(3, chunked.config.vocab_size, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        for m in (None, mask):
            real = torch.ones_like(mask, dtype=torch.bool) if m is None else m.bool()  # padding rows: no contract
            diff = (chunked(ids, attention_mask=m).logits - whole(ids, attention_mask=m).logits).abs()
            assert diff[real].max() <= TOL


@pytest.mark.needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_heads_linear_kernel_equals_the_per_head_bmm(dtype, rows):
    """decode_kernels.c's per-head product, on a head-strided view (MLA's W_uv slice of kv_b_proj), equals
    the fp32 bmm on the same values; 9 rows are past the kernel (None: the caller's bmm runs)."""
    torch.manual_seed(5)
    w_all = torch.randn(3, 48 + 32, 64, dtype=dtype)
    w = w_all[:, 48:]  # [H=3, m=32, k=64], head stride 80 x 64
    x = torch.randn(rows, 3, 64, dtype=dtype)
    with torch.no_grad():
        out = heads_linear(x, w)
        reference = torch.bmm(x.float().transpose(0, 1), w.float().transpose(1, 2)).transpose(0, 1)
        assert heads_linear(torch.randn(9, 3, 64, dtype=dtype), w) is None
    err = (out.float() - reference).abs().max() / reference.abs().max()
    assert out.dtype == dtype and out.shape == (rows, 3, 32) and err <= (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_native_absorption_equals_the_training_path_and_follows_updates(dtype):
    """A one-token step (the native per-head absorption and, in bf16, the native LM head) equals the
    training path's logits, also after kv_b_proj changes in place (the cached transposed W_uk follows)."""
    m = _model(attention_kinds=["dense"] * 3).to(dtype)
    ids = torch.randint(3, m.config.vocab_size, (2, 1))
    tol = 1e-4 if dtype == torch.float32 else 0.03
    fast, ref = _fast_and_reference(m, ids)
    assert "w_uk_t" in m.model.layers[0].self_attn._derived_weights
    assert (fast.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.kv_b_proj.weight.mul_(-2)
    fast, ref = _fast_and_reference(m, ids)
    assert (fast.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@pytest.mark.needs_native
def test_native_bf16_rms_norm_equals_the_fp32_computed_torch_path():
    """bf16 RMSNorm on the inference path runs one C call; it equals the torch ops (fp32 statistics, the normalised
    row rounded to bf16, then the weight product rounded) up to the fp32 sum order: at most a rare 1-ulp
    difference. Strided input (a slice of a fused projection) too; on the reference path the torch ops run."""
    torch.manual_seed(0)
    norm = RMSNorm(256).bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1, 0.5)
    wide = (torch.randn(3, 64, 320) * 4).bfloat16()
    x = wide[..., :256]  # not contiguous
    ref = norm.weight * F.rms_norm(x.float(), (256,), eps=norm.eps).to(torch.bfloat16)
    with torch.no_grad():
        got = INFERENCE.norm(norm, x)
    diff = (got.float() - ref.float()).abs()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert (diff > 0).float().mean() <= 1e-3 and (diff <= ref.float().abs() * 2 ** -7).all()
    y = REFERENCE.norm(norm, x.detach().requires_grad_())
    y.float().sum().backward()
    assert y.grad_fn is not None and torch.equal(y.detach(), ref)
