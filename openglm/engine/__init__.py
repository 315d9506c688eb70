"""openglm.engine: the paged-KV inference engine (nano-vllm style).

`LLM(path).generate(prompts, SamplingParams(...))` for offline batches; `LLMEngine` is the
step-at-a-time core the server drives.
"""

from openglm.engine.config import EngineConfig
from openglm.engine.llm import LLM
from openglm.engine.llm_engine import LLMEngine
from openglm.engine.outputs import CompletionOutput, RequestOutput
from openglm.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
