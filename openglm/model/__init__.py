"""openglm.model: GLM-5 (`glm_moe_dsa`) with MLA, DeepSeek Sparse Attention and MoE; GLM-4.x (`glm4_moe`),
GLM-4.7-Flash (`glm4_moe_lite`) and GLM-5.3-Flash (`glm5_next`), one folder per family (`glm5/`, `glm4/`,
`glm4_lite/`, `glm5_next/`; see family.py). `build_model(cfg)` builds the causal LM of cfg's family.

    from openglm.model import ModelConfig, GlmMoeDsaForCausalLM, load_model, DynamicCache
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset("tiny"))
    logits = model(input_ids, attention_mask=mask, cache=DynamicCache()).logits

Exports resolve lazily (see openglm/util/lazy.py).
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "DynamicCache": "openglm.model.cache",
    "KVCache": "openglm.model.cache",
    "load_model": "openglm.model.checkpoint",
    "save_pretrained": "openglm.model.save",
    "ModelConfig": "openglm.model.config",
    "CausalLMOutput": "openglm.model.model",
    "build_model": "openglm.model.model",
    "Glm5NextForCausalLM": "openglm.model.glm5_next.model",
    "GlmMoeDsaForCausalLM": "openglm.model.model",
    "MoEStats": "openglm.model.model",
    "PRESETS": "openglm.model.presets",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
