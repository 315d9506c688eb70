"""With the context-aware router on, the engine's greedy output equals the model's own greedy decoding (a full forward
per token, no cache): its state lives in the paged pool as per-token entries, through chunked prefill, prefix-cache
hits, preemption and speculative drafts that are rejected."""

import pytest
import torch
from testutil import run_requests

from openglm.engine import EngineConfig, LLMEngine, SamplingParams
from openglm.model.context_router import ContextRouter

NEW_TOKENS = 20
PROMPT_LENGTHS = (3, 11, 29, 40)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random model (a 6-token summary window, so decode crosses its edge) whose context weights are large
    enough to decide experts; with the next-n layer, which has a context router of its own."""
    from openglm.engine.random_checkpoint import build_random_checkpoint
    from openglm.model import load_model, save_pretrained
    from openglm.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("ckpt")
    base = build_random_checkpoint(root / "untrained", index_n_heads=16, num_nextn_predict_layers=1,
                                   router_context="gated", router_context_window=6)
    model = load_model(str(base), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ContextRouter):
                m.context_weight.normal_(0.0, 2.0)
    save_pretrained(model, root / "tiny-ctx")
    Tokenizer.from_checkpoint(base).save(root / "tiny-ctx")
    return root / "tiny-ctx"


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(10, 380, (20,), generator=g).tolist()
    plain = [torch.randint(10, 380, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return plain + [shared + [11, 12, 13], shared + [50]]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """The model's own greedy continuation of each prompt: the whole sequence through `forward` every token."""
    from openglm.model import load_model

    model = load_model(str(checkpoint), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


def generate(checkpoint, prompts, **config):
    """All prompts but the last batched together, then the last, whose first 20 tokens are then cached blocks (the
    router state of those positions is read from the pool, never recomputed)."""
    engine = LLMEngine.from_pretrained(str(checkpoint), EngineConfig(**config))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_requests(engine, [(p, params) for p in prompts[:-1]])
    outs += run_requests(engine, [(prompts[-1], params)])
    assert engine.block_manager.num_used_blocks == 0
    return engine, outs


@pytest.mark.parametrize("config", [
    dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=2048),
    dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=12),  # chunked prefill beside decodes
    dict(num_kv_blocks=16, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False),  # preemption
    dict(num_kv_blocks=128, block_size=4, max_num_batched_tokens=12, num_speculative_tokens=3),
], ids=["one-shot", "chunked", "preempted", "speculative"])
def test_engine_greedy_equals_the_models_own_greedy(checkpoint, prompts, reference, config):
    engine, outs = generate(checkpoint, prompts, **config)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if config["num_kv_blocks"] == 16:
        assert engine.scheduler.num_preemptions > 0
    if config.get("num_speculative_tokens"):
        assert engine.counters["draft_tokens"] > 0
    if config.get("enable_prefix_caching", True):
        assert outs[-1].num_cached_tokens == 20  # five full blocks of the shared prefix
