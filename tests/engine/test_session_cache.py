"""Prefix caching as the session cache: a multi-turn chat reuses its earlier turns' KV blocks until
they have been idle longer than the TTL."""

from openglm.engine import LLM, SamplingParams

# thinking off: the generation prompt `<|assistant|></think>` is how the answered turn renders next
# time, so a turn's prompt is a prefix of the next one (with thinking on it ends `<think>` instead)
NO_THINK = {"enable_thinking": False}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_multi_turn_prefix_hit_then_ttl_expiry(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), num_kv_blocks=64, session_ttl=30.0)
    clock = Clock()
    llm.engine.block_manager.clock = clock
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    history = [{"role": "system", "content": "You are a careful assistant that writes Python code."},
               {"role": "user", "content": "Write a function that reverses a list in place."}]
    turn1 = llm.chat(history, params, use_tqdm=False, chat_template_kwargs=NO_THINK)[0]
    assert turn1.num_cached_tokens == 0
    history += [{"role": "assistant", "content": turn1.outputs[0].text},
                {"role": "user", "content": "Now make it return a new list instead."}]

    clock.t += 10  # within the TTL: the first turn's full blocks are reused
    turn2 = llm.chat(history, params, use_tqdm=False, chat_template_kwargs=NO_THINK)[0]
    prompt1 = len(turn1.prompt_token_ids)
    assert turn2.num_cached_tokens >= (prompt1 // 16) * 16 > 0
    assert turn2.prompt_token_ids[: prompt1] == turn1.prompt_token_ids

    clock.t += 31  # idle longer than the TTL: the session's blocks are forgotten
    turn2_again = llm.chat(history, params, use_tqdm=False, chat_template_kwargs=NO_THINK)[0]
    assert turn2_again.num_cached_tokens == 0
    assert llm.engine.block_manager.stats["expired"] > 0
    # recomputing from scratch gives the same greedy answer as the cached run
    assert turn2_again.outputs[0].token_ids == turn2.outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0
