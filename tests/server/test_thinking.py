"""Thinking under control: the switches (chat_template_kwargs, Z.ai's `thinking`, `reasoning_effort`, the
server's `--default-chat-template-kwargs`), the budget after which `</think>` is forced (so a constrained
answer always gets its structure with thinking on), and the reasoning mode read from the prompt (GLM-4.5/4.6
templates leave the `<think>` to the model). In-process servers on the random-weight checkpoint; the
engine records each prompt and its SamplingParams."""

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

MODEL = "tiny-test"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
TOOL = {"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}}
GLM46 = Path(__file__).parents[1] / "train" / "glm_templates" / "GLM-4.6.jinja"


def recording(url, engine):
    """An OpenAI client for the server, and the (prompt text, SamplingParams) of every request it queues."""
    seen = []
    add = engine.add_request

    def record(prompt, params=None, request_id=None, group=None):
        seen.append((engine.tokenizer.decode(list(prompt), skip_special_tokens=False), params))
        return add(prompt, params, request_id, group)

    engine.add_request = record
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), seen


@pytest.fixture(scope="module")
def plain(start_server):
    return recording(*start_server(max_model_len=1024, num_kv_blocks=256))


@pytest.fixture(scope="module")
def defaults_off(start_server):
    """A server started with --default-chat-template-kwargs '{"enable_thinking": false}' --thinking-token-budget 9."""
    return recording(*start_server(app_kw={"default_chat_template_kwargs": {"enable_thinking": False},
                                           "thinking_token_budget": 9}, max_model_len=1024, num_kv_blocks=256))


@pytest.mark.parametrize("body,ends,budget", [
    ({}, "<think>", None),
    ({"thinking": {"type": "disabled"}}, "</think>", None),
    ({"thinking": {"type": "enabled"}, "thinking_token_budget": 7}, "<think>", 7),
    ({"reasoning_effort": "none"}, "</think>", None),
    ({"reasoning_effort": "low"}, "<think>", 1024),
    ({"reasoning_effort": "high", "thinking_token_budget": 3}, "<think>", 3),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "</think>", None),
])
def test_the_switches_reach_the_prompt_and_the_budget(plain, body, ends, budget):
    client, seen = plain
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=body)
    prompt, params = seen[-1]
    assert prompt.endswith(ends) and params.thinking_budget == budget
    assert budget is None or params.thinking_open  # the prompt opened the reasoning: the budget counts from it


@pytest.mark.parametrize("body,ends,budget", [
    ({}, "</think>", None),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "<think>", 9),
    ({"thinking": {"type": "enabled"}, "thinking_token_budget": 2}, "<think>", 2),
])
def test_server_defaults_apply_where_the_request_is_silent(defaults_off, body, ends, budget):
    client, seen = defaults_off
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=body)
    prompt, params = seen[-1]
    assert prompt.endswith(ends) and params.thinking_budget == budget


def test_the_budget_ends_the_reasoning(plain):
    client, _ = plain
    kw = dict(model=MODEL, messages=ASK, max_tokens=24, seed=3, temperature=1.0)
    free = client.chat.completions.create(**kw).choices[0].message
    assert free.content == "" and free.reasoning_content  # a random model does not close its reasoning itself
    capped = client.chat.completions.create(extra_body={"thinking_token_budget": 4}, **kw).choices[0].message
    assert capped.content and capped.reasoning_content and capped.reasoning == capped.reasoning_content
    assert free.reasoning_content.startswith(capped.reasoning_content)  # the same start, cut after 4 tokens


def test_a_constrained_answer_with_thinking_on_gets_its_structure(plain):
    """No budget given: a constrained answer thinks for at most half its max_tokens, then writes its structure."""
    client, seen = plain
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, seed=1, response_format=FORMAT)
    assert seen[-1][1].thinking_budget == 40
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=160, seed=2, tools=[TOOL],
                                                tool_choice="required", stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            calls[tc.index] = calls.get(tc.index, "") + tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMA)


def test_a_call_before_think_end_ends_the_reasoning_and_the_budget(scripted):
    """A model that skips `</think>` and goes straight to its call: the call ends the reasoning, so a budget
    shorter than the call forces no `</think>` into it."""
    client, reply = scripted
    reply("Oslo.<tool_call>forecast<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
          "<arg_value>3</arg_value></tool_call>")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=80,
                                         extra_body={"thinking_token_budget": 7}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.model_extra["reasoning_content"] == "Oslo."
    (call,) = out.message.tool_calls
    assert call.function.name == "forecast" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 3}


def test_reasoning_is_accepted_back_in_assistant_messages(plain):
    client, seen = plain
    call = {"id": "c1", "type": "function", "function": {"name": "forecast", "arguments": '{"city": "Oslo"}'}}
    messages = ASK + [{"role": "assistant", "content": "", "reasoning": "check Oslo first", "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=1)
    assert "<think>check Oslo first</think>" in seen[-1][0]


@pytest.fixture(scope="module")
def glm46(checkpoint, tmp_path_factory, start_server):
    """The same weights behind GLM-4.6's published template (its prompt leaves the <think> to the model)."""
    import uvicorn  # noqa: F401 - start_server's dependency, imported here for a clear skip-free failure
    from testutil import serve_in_thread

    from openglm.engine import EngineConfig, LLMEngine
    from openglm.server.app import create_app

    folder = tmp_path_factory.mktemp("glm46") / "tiny"
    shutil.copytree(checkpoint, folder)
    (folder / "chat_template.jinja").write_text(GLM46.read_text())
    engine = LLMEngine.from_pretrained(folder, EngineConfig(max_model_len=1024, num_kv_blocks=256))
    url, stop = serve_in_thread(create_app(engine, MODEL))
    yield recording(url, engine)
    stop()


def test_a_template_that_leaves_think_to_the_model(glm46):
    client, seen = glm46
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, seed=4, response_format=FORMAT)
    prompt, params = seen[-1]
    assert prompt.endswith("<|assistant|>") and params.thinking_open is False and params.thinking_budget == 40
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, seed=4).choices[0].message
    assert text.content and not getattr(text, "reasoning_content", None)  # nothing opened a reasoning block
