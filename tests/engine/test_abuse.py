"""The engine side of the second hostile-input review: one request of many prompts x n cannot starve a small one,
and the per-step output bookkeeping does not grow with the output (each test failed on the code before)."""

import random

from openglm.engine import EngineConfig, LLMEngine, SamplingParams
from openglm.engine.block_manager import BlockManager
from openglm.engine.postprocess import update_text
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence


def step(sched: Scheduler) -> list[Sequence]:
    """Schedule one step and pretend the model ran it (a prefill completes, a decode adds a token)."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return batch.seqs


def test_a_huge_n_times_prompts_request_does_not_starve_a_small_one():
    cfg = EngineConfig(block_size=4, num_kv_blocks=4096, max_num_seqs=16, max_num_batched_tokens=512,
                       max_seqs_per_request=4)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    for i in range(256 * 16):  # one client request: 256 prompts x n=16, long answers
        sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=1000), f"big-{i // 16}", index=i % 16, group="big"))
    for _ in range(3):
        step(sched)
    assert len(sched.running) == 16  # alone, it uses every slot
    small = Sequence([4, 5], SamplingParams(max_tokens=4), "chat")
    sched.add(small)
    for steps in range(1, 40):
        if small in step(sched) and small.num_output_tokens >= 4:
            break
    assert small.num_output_tokens >= 4 and steps <= 8, steps  # before: after every big sequence (60,000+ steps)
    assert sched.running_per_group["big"] <= 16 and sched.num_preemptions >= 1
    for s in list(sched.running) + sched.waiting:
        sched.finish(s, "abort")
    assert sched.num_unfinished == 0 and sched.block_manager.num_used_blocks == 0


def test_groups_take_turns_and_a_lone_group_keeps_every_slot():
    cfg = EngineConfig(block_size=4, num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=256,
                       max_seqs_per_request=2)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    for g in ("a", "b", "c"):
        for i in range(8):
            sched.add(Sequence([1, 2], SamplingParams(max_tokens=100), f"{g}{i}", group=g))
    step(sched)
    # fewest running first: the 8 slots go round the three groups, not to the first group's 8 sequences
    assert sorted(sched.running_per_group.values()) == [2, 3, 3]
    for s in [s for s in sched.running if s.group != "a"] + [s for s in sched.waiting if s.group != "a"]:
        sched.finish(s, "abort")
    step(sched)
    assert sched.running_per_group == {"a": 8}  # alone again: work-conserving


def test_per_step_output_bookkeeping_does_not_grow_with_the_output(tiny_checkpoint):
    """Each step decodes only the new tokens (with the previous decode's as context) and reports only what is
    new; before, every step decoded the whole output and copied its text, ids and logprobs."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64, max_model_len=1024))
    decode, widths = engine.tokenizer.decode, []
    engine.tokenizer.decode = lambda ids, **kw: widths.append(len(ids)) or decode(ids, **kw)
    engine.postprocess.decode = engine.tokenizer.decode
    engine.add_request("def f():", SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True,
                                                  stop=["\x00never"], logprobs=1))
    text, tokens, final = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            c = out.outputs[0]
            assert c.text_offset == len(text) and len(c.delta_token_ids) <= 1 and len(c.delta_logprobs) <= 1
            text, tokens = text + c.delta_text, tokens + c.delta_token_ids
            if not out.finished:
                assert c.text is None and c.token_ids is None  # a running output holds no copy of the whole
            final = out
    c = final.outputs[0]
    assert c.token_ids == tokens and len(tokens) == 400 and c.text == text == decode(tokens)
    assert max(widths) <= 32, max(widths)  # before: up to all 400 output tokens per decode


def test_incremental_detokenization_equals_decoding_the_whole(tiny_checkpoint):
    """Random token ids (many are single bytes: split multi-byte characters, invalid UTF-8, special tokens)
    decoded a token at a time give the text decoding them all at once gives."""
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=8))
    decode, vocab = engine.tokenizer.decode, engine.tokenizer.vocab_size
    for trial in range(200):
        rng = random.Random(trial)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        seq = Sequence([1], SamplingParams(max_tokens=100))
        for token in ids:
            seq.append_token(token)
            update_text(seq, decode)
            assert decode(ids).startswith(seq.output_text)  # never ahead of, never different from, the whole
        update_text(seq, decode, final=True)
        assert seq.output_text == decode(ids), trial
