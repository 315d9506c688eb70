"""The Triton experts (`openglm.kernels.moe`) against the model's own PyTorch experts (`moe.Experts`).

Without CUDA these run in Triton's interpreter on the CPU (tests/conftest.py), so the shapes are tiny: every
launch is a handful of programs. With CUDA the same tests run the compiled kernels.

Tolerances (max |kernel - reference| / max |reference|):
- fp32: 1e-5 (the same products; only the summation order differs);
- bf16: 2e-2 against the fp32 computation on the same bf16 inputs (the kernel rounds twice, the silu * up
  intermediate and the output; bf16 keeps 8 bits: a rounding is up to 2^-9 relative);
- int8 / fp8 weights: 1e-5 against the fp32 experts on the dequantised weights (fp32 activations), 2e-2 in bf16.
"""

import pytest
import torch

from openglm.engine.quant import quantize_tensor
from openglm.model import ModelConfig
from openglm.model.fp8 import dequantize, quantize
from openglm.model.moe import Experts
from openglm.model.quantized import QuantizedWeight

kernels = pytest.importorskip("openglm.kernels.moe", reason="triton is a test dependency (pyproject's test extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_experts(n_experts=6, hidden=48, inter=40, dtype=torch.float32, seed=0) -> Experts:
    cfg = ModelConfig.from_preset("tiny", n_routed_experts=n_experts, hidden_size=hidden, moe_intermediate_size=inter,
                                  num_experts_per_tok=2, n_group=1, topk_group=1)
    experts = Experts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * hidden ** -0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * inter ** -0.5)
    return experts.to(dtype)


def routing(n_tokens, k, n_experts, seed=1, skip=()):
    """Distinct experts per token (as top-k gives), never one in `skip`, and fp32 routing weights."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in skip])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n_tokens)])
    return idx, torch.rand(n_tokens, k, generator=g) + 0.1


def reference(experts: Experts, x, idx, w) -> torch.Tensor:
    """The model's own experts in fp32 (CPU, no autograd) on the same (possibly bf16) inputs."""
    with torch.no_grad():
        return experts.float()(x.float(), idx, w)[0]


def rel_err(got, ref) -> float:
    return float((got.float().cpu() - ref.float()).abs().max() / ref.abs().max())


def run(experts: Experts, x, idx, w, **kw):
    gu, dn = (kernels.ExpertWeights(t.detach().to(DEVICE)) for t in (experts.gate_up_proj, experts.down_proj))
    return kernels.fused_experts(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), gu, dn, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tokens,k", [(3, 2), (37, 2), (5, 1)])  # decode-like, several blocks per expert, top-1
def test_fused_experts_match_the_models_experts(dtype, n_tokens, k):
    experts = make_experts(dtype=dtype)
    x = torch.randn(n_tokens, 48).to(dtype)
    idx, w = routing(n_tokens, k, 6, skip=(4,))  # expert 4 gets no token: its blocks must not exist
    out = run(experts, x, idx, w)
    assert out.dtype == dtype and out.shape == (n_tokens, 48)
    assert rel_err(out, reference(experts, x, idx, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widths_in_whole_k_tiles(dtype):
    # hidden and expert width multiples of BLOCK_K: the kernels' unmasked K loop (the real widths take it)
    experts = make_experts(hidden=64, inter=64, dtype=dtype)
    x = torch.randn(21, 64).to(dtype)
    idx, w = routing(21, 2, 6)
    assert rel_err(run(experts, x, idx, w), reference(experts, x, idx, w)) < TOL[dtype]
    qexperts, stacks = quantized_experts("fp8", dtype, hidden=64, inter=64)
    out = kernels.fused_experts(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), stacks["gate_up_proj"], stacks["down_proj"])
    assert rel_err(out, reference(dequantized(qexperts, 64, 64), x, idx, w)) < TOL[dtype]


def test_several_row_blocks_per_expert_and_narrow_tiles():
    # 16-row blocks and 16-wide column tiles: an expert's rows span blocks, outputs span column tiles
    experts = make_experts()
    x = torch.randn(29, 48)
    idx, w = routing(29, 2, 6)
    out = run(experts, x, idx, w, tiles=kernels.Tiles(16, 16, 16))
    assert rel_err(out, reference(experts, x, idx, w)) < TOL[torch.float32]


def test_align_groups_assignments_by_expert_in_token_order():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert = kernels.align_by_expert(idx, n_experts=4, block_m=2)
    m = idx.numel()
    # expert 0: assignments 1, 4; expert 1: 3 (+ pad); expert 2: 0, 2, 5 (+ pad); expert 3: none
    assert sorted_ids.tolist()[:8] == [1, 4, 3, m, 0, 2, 5, m]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]
    assert (block_expert[4:] == -1).all() and (sorted_ids[8:] == m).all()


def quantized_experts(kind: str, dtype=torch.float32, **shape):
    """The model's experts holding `--quantization` weights (one scale per output row) as QuantizedWeight buffers."""
    experts = make_experts(dtype=dtype, **shape)
    stacks = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        qw = QuantizedWeight(*quantize_tensor(p, kind), dtype=p.dtype)
        delattr(experts, name)
        experts.register_buffer(name, qw, persistent=False)
        stacks[name] = kernels.per_row(qw.qdata.to(DEVICE), qw.scale.to(DEVICE))
    return experts, stacks


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_quantised_weights_are_read_as_stored(kind, dtype):
    experts, stacks = quantized_experts(kind, dtype)
    x = torch.randn(9, 48).to(dtype)
    idx, w = routing(9, 2, 6)
    out = kernels.fused_experts(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), stacks["gate_up_proj"], stacks["down_proj"])
    assert rel_err(out, reference(dequantized(experts), x, idx, w)) < TOL[dtype]


def dequantized(experts: Experts, hidden=48, inter=40) -> Experts:
    """fp32 experts on the dequantised weights: what the int8 / fp8 values with their row scales stand for."""
    plain = make_experts(hidden=hidden, inter=inter)
    with torch.no_grad():
        plain.gate_up_proj.copy_(experts.gate_up_proj.qdata.float() * experts.gate_up_proj.scale)
        plain.down_proj.copy_(experts.down_proj.qdata.float() * experts.down_proj.scale)
    return plain


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_fp8_block_scaled_weights_in_the_checkpoint_layout(block):
    # GLM's FP8 checkpoints: e4m3 values and one scale per 128 x 128 block (fp8.quantize writes that layout);
    # (16, 32) blocks exercise the block indexing at tiny widths: 3 row blocks of gate_up, 2 column blocks.
    experts = make_experts()
    values, scales = {}, {}
    for name in ("gate_up_proj", "down_proj"):
        per = [quantize(w, block) for w in getattr(experts, name).detach()]
        values[name] = torch.stack([v for v, _ in per])
        scales[name] = torch.stack([s for _, s in per])
        with torch.no_grad():  # the reference: the model's own dequantisation of the checkpoint tensors
            getattr(experts, name).copy_(torch.stack([dequantize(v, s, block) for v, s in per]))
    x = torch.randn(11, 48)
    idx, w = routing(11, 2, 6)
    gu, dn = (kernels.ExpertWeights(values[n].to(DEVICE), scales[n].to(DEVICE), block)
              for n in ("gate_up_proj", "down_proj"))
    out = kernels.fused_experts(x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), gu, dn)
    assert rel_err(out, reference(experts, x, idx, w)) < TOL[torch.float32]


def test_bad_inputs_get_clear_errors():
    experts = make_experts()
    gu, dn = kernels.ExpertWeights(experts.gate_up_proj.detach()), kernels.ExpertWeights(experts.down_proj.detach())
    x = torch.randn(2, 48)
    with pytest.raises(IndexError, match=r"expert indices must be in \[0, 6\)"):
        on = [t.to(DEVICE) for t in (x, torch.tensor([[0, 6], [1, 2]]), torch.ones(2, 2))]
        kernels.fused_experts(*on, *(kernels.ExpertWeights(w.values.to(DEVICE)) for w in (gu, dn)))
    with pytest.raises(ValueError, match="expected \\[N, H\\], \\[N, k\\], \\[N, k\\]"):
        kernels.fused_experts(x, torch.zeros(2, 2, dtype=torch.long), torch.ones(3, 2), gu, dn)
    with pytest.raises(ValueError, match="int8 weights need scales"):
        kernels.fused_experts(x, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2),
                              kernels.ExpertWeights(torch.zeros(6, 80, 48, dtype=torch.int8)), dn)
