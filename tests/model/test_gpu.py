"""The model's GPU dispatch (`model/gpu.py`): the MoE layer and the DSA path handing their tensors to the Triton
kernels, the autograd fallbacks, and the whole model with the kernels in place.

Without CUDA, the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py), and the tests that
need the dispatch to fire point `gpu.kernel_device` at the CPU; with CUDA the same tests run on the device.
References are the model's PyTorch ops (`gpu.pytorch_ops()`). Tests marked `gpu` run CUDA-only checks
(deselected without a CUDA device; see tests/conftest.py). Tolerances as in tests/kernels.
"""

import subprocess
import sys

import pytest
import torch
from testutil import kernels_at_every_dispatch

from openglm.engine.quant import quantize_model
from openglm.model import DynamicCache, GlmMoeDsaForCausalLM, ModelConfig, gpu
from openglm.model.glm5 import sparse_dsa
from openglm.model.moe import Experts

pytest.importorskip("triton", reason="triton is a test dependency (pyproject's test extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_model(dtype=torch.float32, **overrides) -> GlmMoeDsaForCausalLM:
    # 16 index heads: relu zeros tie at the top-k boundary with 4 (see tests/engine/conftest.py)
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", index_n_heads=16, **overrides)
    return GlmMoeDsaForCausalLM(cfg).to(dtype).eval().to(DEVICE)


def moe_inputs(model, n=13, seed=1):
    layer = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, model.config.hidden_size, generator=g).to(model.dtype).to(DEVICE)
    with torch.no_grad():
        r = layer.gate(x, with_probs=False)
    return layer.experts, x, r.indices, r.weights


def test_experts_dispatch_matches_the_pytorch_experts():
    experts, x, idx, w = moe_inputs(tiny_model())
    with torch.no_grad(), gpu.pytorch_ops():
        ref, _ = experts(x, idx, w)
    with torch.no_grad():
        got = gpu.experts_forward(experts, x, idx, w)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_experts_dispatch_reads_quantized_weights_in_place():
    model = tiny_model()
    quantize_model(model, "int8")
    experts, x, idx, w = moe_inputs(model)
    with torch.no_grad(), gpu.pytorch_ops():
        ref, _ = experts(x, idx, w)  # the model's own op: the weights dequantised per op
    with torch.no_grad():
        got = gpu.experts_forward(experts, x, idx, w)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_experts_backward_is_the_pytorch_experts_backward():
    """Training: the kernels' forward, then the PyTorch experts recomputed for the backward, whose gradients
    are therefore exactly those of the PyTorch path for the same output gradient."""
    experts, x, idx, w = moe_inputs(tiny_model())
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grads = []
    for use_kernels in (True, False):
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with gpu.pytorch_ops() if not use_kernels else torch.enable_grad():
            out = gpu.experts_forward(experts, xi, idx, wi) if use_kernels else experts(xi, idx, wi)[0]
            (out * g).sum().backward()
        grads.append([xi.grad, wi.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()])
    for got, ref in zip(*grads):
        assert torch.equal(got, ref)


def test_experts_dispatch_declines_what_the_kernels_do_not_cover():
    experts = Experts(ModelConfig.from_preset("tiny", hidden_act="gelu"))
    x = torch.randn(3, 64)
    assert gpu.experts_forward(experts, x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)) is None


def latent_inputs(b=2, tq=6, tk=30, heads=4, rank=32, rope=8, seed=0):
    """q [B, H, Tq, D] and one latent key head [B, 1, Tk, D] whose leading `rank` channels are the values (a view),
    laid out as MLAttention passes them; indexer inputs; left padding on row 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, heads, rank + rope, generator=g).transpose(1, 2)
    k = torch.randn(b, tk, 1, rank + rope, generator=g).transpose(1, 2)
    iq, ik = torch.randn(b, tq, 16, 16, generator=g), torch.randn(b, tk, 16, generator=g)
    iw = torch.rand(b, tq, 16, generator=g) * 0.25
    valid = torch.ones(b, tk, dtype=torch.bool)
    valid[0, :5] = False
    q, k, iq, ik, iw, valid = (t.to(DEVICE) for t in (q, k, iq, ik, iw, valid))
    return q, k, k[..., :rank], iq, ik, iw, valid


def test_dsa_dispatch_matches_the_models_dsa():
    q, k, v, iq, ik, iw, valid = latent_inputs()
    kw = dict(scale=0.3, index_scale=0.25, key_mask=valid, return_slots=True)
    with torch.no_grad(), gpu.pytorch_ops():
        ref, ref_slots = sparse_dsa.dsa_attention(q, k, v, iq, ik, iw, 8, **kw)
    with torch.no_grad():
        got, got_slots = gpu.dsa_attention(q, k, v, iq, ik, iw, 8, **kw)
        shared = gpu.gather_attention(q, k, v, ref_slots, 0.3)  # a 'shared' indexer layer reuses the slots
    assert torch.equal(got_slots, ref_slots.long())
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6) and torch.allclose(shared, ref, rtol=1e-5, atol=1e-6)


def test_dsa_dispatch_with_autograd_attends_through_the_pytorch_gather():
    q, k, v, iq, ik, iw, valid = latent_inputs()
    q.requires_grad_()
    out = gpu.dsa_attention(q, k, v, iq, ik, iw, 8, scale=0.3, index_scale=0.25, key_mask=valid)
    with gpu.pytorch_ops():
        ref = sparse_dsa.dsa_attention(q, k, v, iq, ik, iw, 8, scale=0.3, index_scale=0.25, key_mask=valid)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Without CUDA, the dispatch points take CPU tensors to the kernels (in Triton's interpreter), as they take
    CUDA ones; returns the number of calls each dispatch function received."""
    return kernels_at_every_dispatch(monkeypatch)


def generate_logits(model, ids, steps=2):
    """Prefill, then `steps` greedy decode steps over a DynamicCache: the logits of every step."""
    cache, out = DynamicCache(), []
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        out.append(logits)
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, cache=cache).logits
            out.append(logits)
    return out


def test_model_with_the_kernels_matches_the_pytorch_model(kernels_on_cpu):
    """The tiny model (MoE layers, DSA with an own and a shared indexer) with every dispatch point taking the
    kernels: prefill of 12 tokens (past index_topk = 8, so DSA selects) and two decode steps."""
    model = tiny_model()
    ids = torch.randint(3, 380, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = generate_logits(model, ids)
    # 3 forwards: 2 MoE layers, 2 layers with an own indexer, 1 sharing its selection, each time
    assert kernels_on_cpu == {"experts_forward": 6, "dsa_attention": 6, "gather_attention": 3}
    with gpu.pytorch_ops():
        ref = generate_logits(model, ids)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_cpu_path_never_imports_triton():
    code = ("import sys, torch\n"
            "from openglm.model import GlmMoeDsaForCausalLM, ModelConfig, DynamicCache\n"
            "m = GlmMoeDsaForCausalLM(ModelConfig.from_preset('tiny')).eval()\n"
            "ids = torch.randint(3, 300, (1, 12))\n"
            "c = DynamicCache()\n"
            "m(ids, cache=c); m(ids[:, :1], cache=c)\n"
            "loaded = sorted(n for n in sys.modules if n == 'triton' or n.startswith(('triton.', 'openglm.kernels')))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- on a CUDA device ------------------------------------------------------------------------------------

def cuda_model(dtype):
    if not torch.cuda.is_available():
        raise RuntimeError("this test needs a CUDA device (pytest -m gpu selected it)")
    return tiny_model(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_model_with_kernels_matches_the_pytorch_ops(dtype, tol):
    model = cuda_model(dtype)
    ids = torch.randint(3, 380, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    got = generate_logits(model, ids, steps=3)
    with gpu.pytorch_ops():
        ref = generate_logits(model, ids, steps=3)
    for a, b in zip(got, ref):
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < tol
    cpu = generate_logits(tiny_model(torch.float32).cpu(), ids.cpu(), steps=3)
    assert float((got[0].float().cpu() - cpu[0]).abs().max() / cpu[0].abs().max()) < tol


@pytest.mark.gpu
def test_cuda_training_step_with_kernels_matches_the_pytorch_ops():
    model = cuda_model(torch.float32).train()
    ids = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    grads = []
    for kernels in (True, False):
        model.zero_grad()
        with (torch.enable_grad() if kernels else gpu.pytorch_ops()):
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5)
