"""openglm.model: GLM-5 (`glm_moe_dsa`) with MLA, DeepSeek Sparse Attention and MoE (and its relatives: GLM-4.x,
GLM-5.3-Flash in glm5_next/; `build_model(cfg)` picks the class of cfg.model_type).

    from openglm.model import ModelConfig, GlmMoeDsaForCausalLM, load_model, DynamicCache
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny"))
    out = model(input_ids, attention_mask=mask, cache=DynamicCache(), return_aux=True)

Exports resolve lazily (see openglm/util/lazy.py).
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "DynamicCache": "openglm.model.cache",
    "KVCache": "openglm.model.cache",
    "load_model": "openglm.model.checkpoint",
    "save_pretrained": "openglm.model.checkpoint",
    "ModelConfig": "openglm.model.config",
    "CausalLMOutput": "openglm.model.model",
    "build_model": "openglm.model.families",
    "Glm5NextForCausalLM": "openglm.model.glm5_next.model",
    "GlmMoeDsaForCausalLM": "openglm.model.model",
    "MoEStats": "openglm.model.model",
    "PRESETS": "openglm.model.presets",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
