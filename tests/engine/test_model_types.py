"""The engine (paged KV cache, continuous batching) serves glm4_moe (GQA) and glm4_moe_lite (MLA without DSA)
models: its greedy tokens equal the model's own greedy loop."""

from __future__ import annotations

import pytest
import torch

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.sampling_params import SamplingParams
from openglm.model import GlmMoeDsaForCausalLM, ModelConfig


@pytest.mark.parametrize("preset", ["tiny-glm4-moe", "tiny-glm4-moe-lite"])
def test_engine_greedy_equals_model_greedy(preset):
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(ModelConfig.from_preset(preset)).eval()
    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=16, block_size=16))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
    for p in prompts:
        ids, ref = torch.tensor([p]), []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(ids).logits[0, -1].argmax())
                ref.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert done[tuple(p)] == ref
