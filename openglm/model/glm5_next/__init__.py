"""GLM-5.3-Flash (`glm5_next`): KDA linear attention, NoPE MLA with a pooled-key DSA indexer, hyper-connections.

- `kda.py`: the Kimi Delta Attention layer, chunked (prefill, training) and recurrent (decode), explicit state;
- `hyper_connections.py`: the residual streams' mixing around each block;
- `attention.py`: the indexed attention (GLM-5's MLA without RoPE, with the pooled indexer);
- `cache.py`: the hybrid cache (KDA state beside the DSA layers' entries);
- `model.py`: the decoder (`Glm5NextForCausalLM`); `checkpoint.py`: the multimodal checkpoint's names.

    from openglm.model import ModelConfig, build_model
    model = build_model(ModelConfig.from_preset("tiny-glm5-next"))  # a Glm5NextForCausalLM
    cache = model.new_cache()
"""

from openglm.model.family import Family
from openglm.model.glm5_next.attention import IndexedAttention
from openglm.model.glm5_next.checkpoint import GLM5_NEXT
from openglm.util.lazy import lazy_exports


def _causal_lm() -> type:
    # deferred: model.py imports the family table (families.py), which imports this package
    from openglm.model.glm5_next.model import Glm5NextForCausalLM

    return Glm5NextForCausalLM


FAMILY = Family("glm5_next", IndexedAttention, GLM5_NEXT, causal_lm=_causal_lm)

_EXPORTS = {
    "Glm5NextForCausalLM": "openglm.model.glm5_next.model",
    "HybridCache": "openglm.model.glm5_next.cache",
    "LinearState": "openglm.model.glm5_next.kda",
}
__all__ = ["FAMILY", *sorted(_EXPORTS)]
__getattr__ = lazy_exports(__name__, _EXPORTS)
