"""The engine's decode steps run natively (`model/decode_step.py` over the paged pool, no gather) and give the
torch path's tokens: batched sequences of different lengths, chunked prefill, shared prefixes, int8 and int4 weights
(the int4 codes read in place by the step's kernels)."""

import pytest
import torch
from testutil import run_requests

from openglm.engine import EngineConfig, LLMEngine, SamplingParams
from openglm.engine.model_runner import ModelRunner, StepInputs
from openglm.model import load_model
from openglm.model.glm5.decode_step import DecodePlan
from openglm.model.native import decode_kernels
from openglm.tokenizer import Tokenizer

CREATE = DecodePlan.create.__func__


@pytest.mark.needs_native
@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(dtype="bfloat16", quantization="int8"),
                                dict(dtype="bfloat16", quantization="int4")])
def test_engine_native_decode_gives_the_torch_paths_tokens(tiny_checkpoint, monkeypatch, kw):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(10, 380, (20,), generator=g).tolist()
    prompts = [torch.randint(10, 380, (n,), generator=g).tolist() for n in (2, 13, 40)] + [shared, shared + [17, 18]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    counts = {}

    def generate(native: bool):
        def create(cls, *args, **kwargs):
            plan = CREATE(cls, *args, **kwargs) if native else None
            counts[native] = counts.get(native, 0) + (plan is not None)
            return plan

        monkeypatch.setattr(DecodePlan, "create", classmethod(create))
        model = load_model(str(tiny_checkpoint), dtype=getattr(torch, kw["dtype"]))
        engine = LLMEngine(model, Tokenizer.from_checkpoint(str(tiny_checkpoint)),
                           EngineConfig(max_num_batched_tokens=32, block_size=8, **kw))
        return [out.outputs[0].token_ids for out in run_requests(engine, [(p, params) for p in prompts])]

    native, plain = generate(True), generate(False)
    assert counts[True] >= 11 and counts[False] == 0  # every decode step of the batch ran natively
    if kw["dtype"] == "float32":
        assert native == plain
    else:  # bf16 sums in another order: tokens may part at a near-tie, but not from the start
        assert sum(a[:4] == b[:4] for a, b in zip(native, plain)) >= 4


@pytest.mark.needs_native("vnni")
def test_long_prompts_select_through_the_pools_key_shadow(tiny_checkpoint, monkeypatch):
    """Prompts past 32 x index_topk keys: the native step scans the pool's int8 key shadow (written by the torch
    path's prefill and by the native steps alike) and gives the torch path's tokens."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 380, (n,), generator=g).tolist() for n in (300, 333)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(native: bool):
        monkeypatch.setattr(DecodePlan, "create", classmethod(
            lambda cls, *a, **kw: CREATE(cls, *a, **kw) if native else None))
        engine = LLMEngine(load_model(str(tiny_checkpoint)), Tokenizer.from_checkpoint(str(tiny_checkpoint)),
                           EngineConfig(block_size=16, max_model_len=512))
        return [out.outputs[0].token_ids for out in run_requests(engine, [(p, params) for p in prompts])]

    before = decode_kernels().path_selections(0)
    native = generate(True)
    assert decode_kernels().path_selections(0) > before
    assert native == generate(False)


@pytest.mark.needs_native
@pytest.mark.parametrize("n,zero_weights", [(300, False), (520, True)])
def test_blocks_out_of_order_scan_the_keys_themselves(tiny_checkpoint, monkeypatch, n, zero_weights):
    """Blocks of 8 slots in descending order: 16 positions are never 16 adjacent slots, so the native step scores
    every key itself (no shadow bounds) and still gives the torch path's logits. With every index head weight zero
    and past 64 x index_topk keys, every key ties at 0 and the scan stops at the first k keys across the blocks: the
    keys torch.topk keeps."""
    prompt = torch.randint(10, 380, (n,), generator=torch.Generator().manual_seed(6)).tolist()
    table = list(range(n // 8 + 8, 0, -1))

    plans = []

    def logits(native: bool):
        def create(cls, *args, **kwargs):
            plans.append(CREATE(cls, *args, **kwargs) if native else None)
            return plans[-1]

        monkeypatch.setattr(DecodePlan, "create", classmethod(create))
        model = load_model(str(tiny_checkpoint))
        if zero_weights:
            with torch.no_grad():
                for layer in model.model.layers:
                    if layer.self_attn.indexer is not None:
                        layer.self_attn.indexer.weights_proj.weight.zero_()
        runner = ModelRunner(model, num_blocks=len(table) + 1, block_size=8)
        with torch.inference_mode():  # as the engine's steps run (`execute` itself does not enter it)
            out = [runner.execute(StepInputs([prompt], [0], [n], [table]))]
            for i, token in enumerate((11, 12, 13)):
                out.append(runner.execute(StepInputs([[token]], [n + i], [1], [table])))
        return torch.cat(out)

    before = [decode_kernels().path_selections(p) for p in (0, 1)]
    native = logits(True)
    assert sum(p is not None for p in plans) == 3  # the three decode steps ran natively
    assert decode_kernels().path_selections(0) == before[0]
    assert (decode_kernels().path_selections(1) > before[1]) == zero_weights
    plain = logits(False)
    assert (native - plain).abs().max() <= 1e-5 * plain.abs().max()
