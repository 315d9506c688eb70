"""What sets one model family apart, as data: `Family`.

The decoder (`model.py`: embeddings, decoder layers, MoE, norms, LM head, next-n layers), the config, the cache and
the checkpoint IO are shared by every family. A family brings its attention module, the names its checkpoints give
the parameters, optionally a native decode step, and (GLM-5.3-Flash, whose layers differ more) its own subclass of
the decoder. Each lives in its own folder and declares one `FAMILY` there
(`glm5/`, `glm4/`, `glm4_lite/`); `families.py` lists them by Hugging Face model_type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from openglm.model.hf_names import HFNames


@dataclass(frozen=True)
class Family:
    model_type: str  # the Hugging Face config's model_type
    attention: type  # the attention module, built as attention(cfg, layer_idx)
    hf_names: HFNames  # how the family's checkpoints name its parameters
    # A class whose create(layers, cache, input_ids, attention_mask, dtype) gives a plan that runs a decode step's
    # layers natively, or None when it cannot (fast.choose asks for one); None: the family has none.
    decode_step: type | None = None
    # A function returning the family's subclass of model.GlmMoeDsaForCausalLM (imported when first asked for: the
    # decoder module imports this table); None: GlmMoeDsaForCausalLM itself.
    causal_lm: Callable[[], type] | None = None
