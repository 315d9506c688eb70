"""Each model type's causal-LM class and checkpoint layout: the one place that dispatches on `model_type`."""

from __future__ import annotations

from torch import nn

from openglm.model.config import ModelConfig
from openglm.model.glm5_next import checkpoint as glm5_next_checkpoint
from openglm.model.glm5_next.model import Glm5NextForCausalLM
from openglm.model.layout import FLAT, CheckpointLayout
from openglm.model.model import GlmMoeDsaForCausalLM

_CLASSES = {"glm5_next": Glm5NextForCausalLM}
_LAYOUTS = {"glm5_next": glm5_next_checkpoint.LAYOUT}


def causal_lm_class(model_type: str) -> type[GlmMoeDsaForCausalLM]:
    return _CLASSES.get(model_type, GlmMoeDsaForCausalLM)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of cfg's type (on the current default device; weights initialised unless that is meta)."""
    return causal_lm_class(cfg.model_type)(cfg)


def checkpoint_layout(model_type: str, names=None) -> CheckpointLayout:
    """The layout to write a model of this type in, or (given the tensor names of a checkpoint) to read one: a
    flat file of a nesting type (a text-only export) reads as flat."""
    layout = _LAYOUTS.get(model_type, FLAT)
    if names is not None and layout.prefixes and not layout.nests(names):
        return CheckpointLayout(kept=layout.kept)
    return layout
