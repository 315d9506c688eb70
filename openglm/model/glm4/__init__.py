"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (`glm4_moe`): grouped-query attention (`gqa.py`), MoE. No native decode step."""

from openglm.model.family import Family
from openglm.model.glm4.gqa import GQAttention
from openglm.model.hf_names import GLM_MOE

FAMILY = Family("glm4_moe", GQAttention, GLM_MOE)
