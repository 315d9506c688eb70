"""openglm: an open, runnable reimplementation of the GLM-5.1 stack.

Heavy submodules (torch, FastAPI, faiss) are imported lazily so that `openglm --help`
and the agent runtime start fast.
"""

from openglm.util.lazy import lazy_exports
from openglm.util.threads import quiet_wait_policy

# Before torch loads libgomp (it reads its wait policy once): on a machine others share, a thread that finishes a
# parallel region spins briefly, then sleeps, instead of burning the core a competitor needs.
quiet_wait_policy()

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "openglm.model.checkpoint",
    "ModelConfig": "openglm.model.config",
    "GlmMoeDsaForCausalLM": "openglm.model.model",
    "LLM": "openglm.engine.llm",
    "SamplingParams": "openglm.engine.sampling_params",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
