"""openglm.engine: the paged-KV inference engine (nano-vllm style).

`LLM(path).generate(prompts, SamplingParams(...))` for offline batches; `LLMEngine` is the
step-at-a-time core the server drives.

Exports resolve lazily (see openglm/util/lazy.py).
"""

from openglm.util.lazy import lazy_exports

_EXPORTS = {
    "EngineConfig": "openglm.engine.config",
    "LLM": "openglm.engine.llm",
    "LLMEngine": "openglm.engine.llm_engine",
    "PromptError": "openglm.engine.llm_engine",
    "CompletionOutput": "openglm.engine.outputs",
    "RequestOutput": "openglm.engine.outputs",
    "SamplingParams": "openglm.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
