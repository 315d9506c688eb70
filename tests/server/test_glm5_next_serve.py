"""A glm5_next (GLM-5.3-Flash layout: KDA + pooled DSA, hybrid cache) random-weight checkpoint through `openglm serve`
(the real CLI, a subprocess), answering the `openai` SDK: a plain reply, the same reply streamed, thinking on and off,
a forced tool call, and a 400 for an image content part."""

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from testutil import openglm_serve

MODEL = "tiny-glm5-next"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from openglm.engine.random_checkpoint import build_random_checkpoint

    # 16 index heads: no exact pooled top-k ties (tests/engine/conftest.py)
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "glm5next", preset="tiny-glm5-next",
                                   index_n_heads=16)


@pytest.fixture(scope="module")
def client(checkpoint):
    with openglm_serve(checkpoint, "--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "128",
                       "--max-num-batched-tokens", "64", "--threads", "1", "--log-level", "warning") as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_checkpoint_is_glm5_next(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "glm5_next"


def test_plain_and_streamed_replies_agree(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, **NO_THINK})
    whole = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert choice.message.content and choice.message.content == again.choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == choice.message.content and finish == "length"


def test_forced_tool_call(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, seed=3,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         parallel_tool_calls=False, extra_body=NO_THINK)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_image_content_part_is_refused(client):
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[image], max_tokens=4)
    assert err.value.status_code == 400
    message = err.value.body["message"]
    assert "image input is not supported for this checkpoint" in message and "messages.0.content" in message


def test_thinking_on_by_default(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.reasoning_content and "</think>" not in message.reasoning_content + (message.content or "")
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert text == message.reasoning_content
    off = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True, **NO_THINK}}).choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content
