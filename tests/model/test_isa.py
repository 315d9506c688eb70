"""model/isa.py: the expert path chosen from the CPU's instruction set, and the oneDNN packed path AMX CPUs take.

The packed path runs on any CPU oneDNN supports (without AMX on AVX-512 / AVX2 kernels), so its numerics are
checked everywhere (`OPENGLM_EXPERTS=onednn` forces it); that it reaches the AMX tiles is checked where there are
some (the `amx` marker: deselected on other CPUs). Tolerance: each of its three matmuls accumulates in fp32 and
rounds its output to bf16 once, as the grouped path does, so both stay within a few bf16 roundings (3%) of the fp32
SwiGLU of the same bf16 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openglm.model import ModelConfig, fast, isa
from openglm.model.isa import CpuFeatures, experts_path
from openglm.model.moe import Experts

PREFILL = [12, 0, 20, 9, 11, 0, 30, 10]  # every active expert above FEW_ROWS rows: a prefill's counts


def _experts(seed: int = 0) -> Experts:
    cfg = ModelConfig.from_preset("tiny", hidden_size=64, moe_intermediate_size=64)
    experts = Experts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.05)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.05)
    return experts.bfloat16()


def _reference(experts: Experts, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    gu, dn = experts.gate_up_proj.float(), experts.down_proj.float()
    out, start = [], 0
    for e, n in enumerate(counts):
        g, u = (xs[start:start + n].float() @ gu[e].t()).chunk(2, dim=-1)
        out.append((F.silu(g) * u) @ dn[e].t())
        start += n
    return torch.cat(out)


def test_experts_path_follows_amx_and_the_override(monkeypatch):
    monkeypatch.delenv("OPENGLM_EXPERTS", raising=False)
    amx, plain = CpuFeatures(amx=True, avx512_bf16=True, vnni=True), CpuFeatures(amx=False, avx512_bf16=True, vnni=True)
    assert experts_path(plain) == "grouped"
    assert experts_path(amx) == ("onednn" if torch.backends.mkldnn.is_available() else "grouped")
    monkeypatch.setenv("OPENGLM_EXPERTS", "grouped")
    assert experts_path(amx) == "grouped"
    monkeypatch.setenv("OPENGLM_EXPERTS", "onednn")
    assert experts_path(plain) == "onednn"
    monkeypatch.setenv("OPENGLM_EXPERTS", "bogus")  # not a path: the CPU decides
    assert experts_path(plain) == "grouped"


def test_cpu_features_agree_with_the_kernel_flags():
    f = isa.cpu_features()
    assert f == isa.cpu_features()  # read once
    flags = isa._cpuinfo_flags()
    if flags is not None:
        assert f.amx == ("amx_bf16" in flags and "amx_tile" in flags)
        assert f.avx512_bf16 == ("avx512_bf16" in flags)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("path", ["onednn", "grouped"])
def test_prefill_experts_on_either_path_equal_the_fp32_swiglu(monkeypatch, path):
    monkeypatch.setenv("OPENGLM_EXPERTS", path)
    experts = _experts()
    xs = torch.randn(sum(PREFILL), 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        got = fast.INFERENCE.experts(experts, xs, PREFILL)
    ref = _reference(experts, xs, PREFILL)
    assert got.dtype == torch.bfloat16 and got.shape == xs.shape
    assert (got.float() - ref).abs().max() <= 0.03 * ref.abs().max()
    if path == "onednn":  # packed once, cached with the weights, and the direct call gives the same bits
        assert torch.equal(fast.onednn_experts(experts, xs, PREFILL), got)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_onednn_experts_repack_after_a_weight_update_and_refuse_what_they_do_not_run(monkeypatch):
    experts = _experts()
    xs = torch.randn(sum(PREFILL), 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        before = fast.onednn_experts(experts, xs, PREFILL)
    with torch.no_grad():
        experts.down_proj.mul_(2)  # an optimizer step: the packed copy must follow
    with torch.inference_mode():
        after = fast.onednn_experts(experts, xs, PREFILL)
    assert (after.float() - 2 * before.float()).abs().max() <= 0.02 * before.float().abs().max()
    assert fast.onednn_experts(experts, xs.float(), PREFILL) is None  # fp32 rows: the grouped / per-expert paths
    experts.limit = 7.0  # glm5_next's clamped SwiGLU: the fused SiLU post-op cannot clamp
    assert fast.onednn_experts(experts, xs, PREFILL) is None


@pytest.mark.amx
def test_onednn_experts_run_on_the_amx_tiles(capfd):
    experts = _experts()
    xs = torch.randn(sum(PREFILL), 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        fast.onednn_experts(experts, xs, PREFILL)  # packs the weights (oneDNN reorders), once
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            fast.onednn_experts(experts, xs, PREFILL)
    log = capfd.readouterr().out
    products = [line for line in log.splitlines() if line.startswith("onednn_verbose") and ",exec," in line
                and (",matmul," in line or ",inner_product," in line)]
    assert products and all("amx" in line for line in products), products[:3]
