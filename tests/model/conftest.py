"""Shared fixtures: a transformers reference model and an openglm model with the same random weights."""

from __future__ import annotations

import pytest
import torch

from openglm.model import GlmMoeDsaForCausalLM, ModelConfig

HF_CLASSES = {"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
              "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
              "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")}


def hf_classes(cfg: ModelConfig):
    import transformers

    config_cls, model_cls = HF_CLASSES[cfg.model_type]
    return getattr(transformers, config_cls), getattr(transformers, model_cls)


def hf_config(cfg: ModelConfig):
    d = cfg.to_hf_dict()
    for key in ("openglm", "model_type", "architectures"):
        d.pop(key)
    hcfg = hf_classes(cfg)[0](**d)
    hcfg._attn_implementation = "eager"
    return hcfg


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that every component (norm gains, correction bias, ...) moves the logits."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.dim() == 1:
            p.copy_(0.1 * noise if name.endswith("bias") else 1 + 0.2 * noise)
        else:
            p.copy_(0.15 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_pair(cfg: ModelConfig, seed: int = 0):
    """(transformers model of cfg.model_type, openglm GlmMoeDsaForCausalLM) sharing random weights."""
    HFModel = hf_classes(cfg)[1]
    torch.manual_seed(seed)
    hf = HFModel(hf_config(cfg)).eval()
    randomize(hf, seed)
    ours = GlmMoeDsaForCausalLM(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def padded_batch(vocab: int, lengths: list[int], left: bool = True, seed: int = 0):
    """input_ids, attention_mask, position_ids for a batch of unequal lengths."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            mask[i, T - n:] = 1
        else:
            mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    # index_topk 6 < sequence lengths below, so DSA really sparsifies; layer 1 shares layer 0's top-k.
    return ModelConfig.from_preset("tiny", index_topk=6, index_n_heads=8)


@pytest.fixture(name="make_pair")
def _make_pair_fixture():
    return make_pair


@pytest.fixture(name="padded_batch")
def _padded_batch_fixture():
    return padded_batch


@pytest.fixture(name="hf_config")
def _hf_config_fixture():
    return hf_config


@pytest.fixture(name="randomize")
def _randomize_fixture():
    return randomize
