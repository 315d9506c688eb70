"""`POST /v1/responses` through the real `openai` SDK: the chat path answered as Responses items, whole and
streamed (the events build the same response), replayed input items, and its 400s. The model's reply is
scripted (tests/server/conftest.py), so the expected items are known."""

import json

import pytest
from openai import BadRequestError

from openglm.server.responses import chat_request

MODEL = "tiny-test"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
REPLY = ("plan it</think>Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")


def test_a_response_holds_reasoning_message_and_call(scripted):
    client, reply = scripted
    reply(REPLY)
    out = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=200)
    assert out.status == "completed" and out.incomplete_details is None
    reasoning, message, call = out.output
    assert (reasoning.type, reasoning.content[0].text, reasoning.summary) == ("reasoning", "plan it", [])
    assert (message.type, message.role, message.content[0].text) == ("message", "assistant", "Checking.")
    assert out.output_text == "Checking."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                 {"city": "Paris", "days": 2})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and out.id.startswith("resp_")
    tokens = out.usage.output_tokens_details.reasoning_tokens
    assert 0 < tokens < out.usage.output_tokens and out.usage.total_tokens == out.usage.input_tokens + \
        out.usage.output_tokens
    assert out.tools[0].name == "get_weather" and out.model == MODEL


def test_a_call_before_think_end_ends_the_reasoning_and_its_token_count(scripted):
    client, reply = scripted
    call = REPLY.split("Checking.")[1]
    reply("plan it" + call)  # no </think>: the model went straight to its call
    out = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=200)
    reasoning, fc = out.output
    assert (reasoning.content[0].text, fc.type, json.loads(fc.arguments)) == ("plan it", "function_call",
                                                                             {"city": "Paris", "days": 2})
    # "plan it" is a few tokens; the call and the stop token after it are not reasoning
    assert 0 < out.usage.output_tokens_details.reasoning_tokens < out.usage.output_tokens - 10


def test_the_stream_builds_the_same_response(scripted):
    client, reply = scripted
    reply(REPLY)
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                          max_output_tokens=200, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [item.id for item in final.output] == [item.id for item in done]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan it"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Checking."
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == final.output[2].arguments and json.loads(arguments) == {"city": "Paris", "days": 2}


def test_a_cut_off_response_is_incomplete(scripted):
    client, reply = scripted
    reply("thinking a long time about it")
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "reasoning" and out.output[0].status == "incomplete"


def test_replayed_items_become_the_conversation():
    """What an agent sends back (its previous output items and the tool's output) is the chat it stands for."""
    req = chat_request({"model": MODEL, "instructions": "Be brief.", "tools": [WEATHER], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "user", "content": "Thanks"}],
        "text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "max_output_tokens": 9, "tool_choice": {"type": "function",
                                                                               "name": "get_weather"}})
    messages = req.template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["reasoning_content"] == "call it" and messages[2]["content"] == "Checking."
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert messages[3] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    assert req.response_format.json_schema.name == "f" and req.reasoning_effort == "low"
    assert req.max_completion_tokens == 9 and req.tool_choice.function.name == "get_weather"


@pytest.mark.parametrize("body,param,says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "image_url": "data:,"}]}]},
     "input.0.content.1", "image input is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "stored item"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role", "system"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"reasoning": {"effort": "max"}}, "reasoning.effort", "none"),
])
def test_unusable_requests_are_400_naming_the_field(scripted, body, param, says):
    client, _ = scripted
    with pytest.raises(BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", **body})
    error = e.value.body
    assert error["param"] == param and says in error["message"], error
