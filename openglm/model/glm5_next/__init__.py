"""GLM-5.3-Flash (`glm5_next`): KDA linear attention, NoPE MLA with a pooled-key DSA indexer, hyper-connections.

    from openglm.model import ModelConfig
    from openglm.model.glm5_next import Glm5NextForCausalLM
    model = Glm5NextForCausalLM(ModelConfig.from_preset("tiny-glm5-next"))
    cache = model.new_cache()  # KDA state + DSA entries

Modules: kda.py (the linear-attention layer, chunked and recurrent), hyper_connections.py, attention.py (the
indexed attention), cache.py (the hybrid cache), model.py, checkpoint.py (the checkpoint layout, as data).
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "Glm5NextForCausalLM": "openglm.model.glm5_next.model",
    "HybridCache": "openglm.model.glm5_next.cache",
    "LinearState": "openglm.model.glm5_next.kda",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
