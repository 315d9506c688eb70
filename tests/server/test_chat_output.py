"""The output parser: streamed in any chunking it produces exactly what the whole text gives."""

import json
import random

import pytest

from openglm.server.chat_output import ChatOutputParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}}]
TEXTS = [
    "<think>plan</think>Sure. \n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n<tool_call>get_weather</tool_call>\n",
    "I reason</think>x  <tool_call>bad</tool_call> y <tool_call>get_weather<arg_key>city",
    "no close tag at all </th",
    "</think><tool_call>get_weather\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1]}</arg_value>\n</tool_call>",
]


def parse(text, thinking, chunks=None):
    p = ChatOutputParser(thinking, TOOLS)
    pieces = [text] if chunks is None else chunks
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    return p, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("thinking", [True, False])
def test_any_chunking_gives_the_whole_result(text, thinking):
    whole, _ = parse(text, thinking)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        p, deltas = parse(text, thinking, chunks)
        assert (p.reasoning, p.content) == (whole.reasoning, whole.content)
        assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in whole.calls]
        assert "".join(d.content for d in deltas) == p.content  # what was streamed is never taken back
        assert "".join(d.reasoning for d in deltas) == p.reasoning
        assert ["".join(c.arguments for d in deltas for c in d.calls if c.index == i) for i in range(len(p.calls))] \
            == [c.arguments for c in p.calls]  # the argument pieces are the arguments


def test_typed_arguments_and_finish_reason():
    p, _ = parse(TEXTS[0], True)
    msg, finish = p.message("stop")
    assert finish == "tool_calls" and msg["reasoning_content"] == "plan" and msg["content"] == "Sure."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris", "days": 3}, {}]
    p, _ = parse(TEXTS[3], True)
    assert json.loads(p.calls[0].arguments) == {"opts": {"a": [1]}}
    p, _ = parse(TEXTS[1], True)  # a call the turn cuts off keeps the arguments that arrived (none here)
    assert p.reasoning == "I reason" and p.content == "x  <tool_call>bad</tool_call> y"
    assert p.message("length") == ({"role": "assistant", "content": p.content, "reasoning_content": "I reason",
                                    "tool_calls": [p.calls[0].as_openai()]}, "length")
    assert (p.calls[0].name, p.calls[0].arguments) == ("get_weather", "{}")


def test_arguments_stream_as_generated():
    """A plain-string value streams as it arrives; a typed one when complete; the pieces are the final JSON."""
    p = ChatOutputParser(False, TOOLS)
    pieces = ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa", "r\"is\n", "</arg_value><arg_key>",
              "days</arg_key><arg_value>1", "4</arg_value></tool_call>"]
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    sent = [[(c.index, c.id is not None, c.arguments) for c in d.calls] for d in deltas]
    assert sent == [[(0, True, '{"city": "Pa')], [(0, False, 'r\\"is\\n')], [(0, False, '"')], [],
                    [(0, False, ', "days": 14}')], []]
    assert json.loads(p.calls[0].arguments) == {"city": 'Par"is\n', "days": 14}
    assert p.message("stop")[1] == "tool_calls"


def test_a_call_ends_where_its_body_stops_being_pairs():
    p, _ = parse("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value> and then text", False)
    assert json.loads(p.calls[0].arguments) == {"city": "Rome"} and p.content == " and then text"
    p, _ = parse("<tool_call>get_weather<arg_key>city</arg_key> oops", False)  # a key without a value
    assert p.calls[0].arguments == "{}" and p.content == "<arg_key>city</arg_key> oops"
    p, _ = parse("<tool_call>get_weathers<arg_key>a</arg_key></tool_call>", False)  # not a listed tool: text
    assert p.calls == [] and p.content == "<tool_call>get_weathers<arg_key>a</arg_key></tool_call>"


def test_a_call_inside_the_reasoning_ends_it():
    p, _ = parse("look\n<tool_call>get_weather<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>\n</think>"
                 "answer", True)
    assert (p.reasoning, p.content) == ("look", "answer") and json.loads(p.calls[0].arguments) == {"days": 2}
    p, _ = parse("look <tool_call>nope</tool_call> more</think>answer", True)  # not a call: reasoning goes on
    assert (p.reasoning, p.content, p.calls) == ("look <tool_call>nope</tool_call> more", "answer", [])


def test_without_tools_markers_are_text_and_without_thinking_no_reasoning():
    p = ChatOutputParser(False, None)
    p.feed("a</think><tool_call>x</tool_call>")
    p.finish()
    assert p.message("stop") == ({"role": "assistant", "content": "a</think><tool_call>x</tool_call>"}, "stop")
