"""openglm: an open, runnable reimplementation of the GLM-5.1 stack.

Heavy submodules (torch, FastAPI, faiss) are imported lazily so that `openglm --help`
and the agent runtime start fast.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_model": "openglm.model",
    "ModelConfig": "openglm.model",
    "GlmMoeDsaForCausalLM": "openglm.model",
    "LLM": "openglm.engine",
    "SamplingParams": "openglm.engine",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'openglm' has no attribute {name!r}")
