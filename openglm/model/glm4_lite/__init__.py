"""GLM-4.7-Flash (`glm4_moe_lite`): GLM-5's Multi-head Latent Attention without the DSA indexer (every layer's
attention kind is `dense`), MoE; it decodes through GLM-5's native decode step. Only its config differs from GLM-5
(model_type, no indexer fields, transformers' defaults: `config.py`, `presets.py`)."""

from openglm.model.family import Family
from openglm.model.glm5.decode_step import DecodePlan
from openglm.model.glm5.mla import MLAttention
from openglm.model.hf_names import GLM_MOE

FAMILY = Family("glm4_moe_lite", MLAttention, GLM_MOE, DecodePlan)
