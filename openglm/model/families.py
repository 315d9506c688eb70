"""The model families openglm runs, by Hugging Face model_type (one folder each; see family.py)."""

from __future__ import annotations

from openglm.model.family import Family
from openglm.model.glm4 import FAMILY as GLM4
from openglm.model.glm4_lite import FAMILY as GLM4_LITE
from openglm.model.glm5 import FAMILY as GLM5
from openglm.model.glm5_next import FAMILY as GLM5_NEXT

FAMILIES: dict[str, Family] = {f.model_type: f for f in (GLM5, GLM4, GLM4_LITE, GLM5_NEXT)}


def family_of(model_type: str) -> Family:
    """The family of a model_type ModelConfig accepted (config.py validates it first)."""
    return FAMILIES[model_type]
