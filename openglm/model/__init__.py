"""openglm.model: GLM-5 (`glm_moe_dsa`) with MLA, DeepSeek Sparse Attention and MoE.

    from openglm.model import ModelConfig, GlmMoeDsaForCausalLM, load_model, DynamicCache
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny"))
    out = model(input_ids, attention_mask=mask, cache=DynamicCache(), return_aux=True)
"""

from openglm.model.cache import DynamicCache, KVCache
from openglm.model.checkpoint import load_model, save_pretrained
from openglm.model.config import ModelConfig
from openglm.model.model import CausalLMOutput, GlmMoeDsaForCausalLM, MoEStats
from openglm.model.presets import PRESETS

__all__ = ["ModelConfig", "PRESETS", "GlmMoeDsaForCausalLM", "CausalLMOutput", "MoEStats", "DynamicCache",
           "KVCache", "load_model", "save_pretrained"]
