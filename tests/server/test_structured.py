"""Structured output read from the schema once: what the grammar admits, how arguments come back typed,
which schemas are a 400 (one line, naming the keyword), and that a random model under the grammar ends
with a valid answer within max_tokens (compact JSON, bounded numbers and strings)."""

import json

import jsonschema
import pytest

from openglm.engine import EngineConfig, LLMEngine
from openglm.engine.grammar import GrammarEngine, GrammarError
from openglm.engine.sampling_params import SamplingParams
from openglm.server.chat_output import ChatOutputParser
from openglm.server.errors import APIError
from openglm.server.json_schema import Schema, SchemaError
from openglm.server.protocol import ChatCompletionRequest
from openglm.server.structured import json_layout, request_grammar

# what pydantic writes for a model with a nested model, Optional, Literal, bounded int and str
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "country": {"enum": ["FR", "DE", "JP"], "type": "string"}},
        "required": ["name", "country"], "title": "City"}
RICH = {"$defs": {"City": CITY}, "type": "object", "title": "Forecast",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 10},
            "city": {"$ref": "#/$defs/City"},
            "alt": {"anyOf": [{"$ref": "#/$defs/City"}, {"type": "null"}], "default": None},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"enum": ["C", "F"], "type": "string"},
            "note": {"type": ["string", "null"], "maxLength": 20},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["code", "city", "days", "unit"]}
TOOL = {"type": "function", "function": {"name": "forecast", "parameters": RICH}}
ASK = [{"role": "user", "content": "weather?"}]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=ASK, **kw)


@pytest.fixture(scope="module")
def tok():
    from openglm.engine.random_checkpoint import stdlib_texts
    from openglm.tokenizer import train_tokenizer

    return train_tokenizer(stdlib_texts(), 384)


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarEngine(tok, tok.vocab_size)


def accepts(grammars, tok, grammar: str, text: str) -> bool:
    m = grammars.matcher(grammar)
    return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()


def glm_call(name, pairs) -> str:
    return f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs) \
        + "</tool_call>"


# ---- one reading of the schema ----------------------------------------------------------------------
def test_types_follow_refs_unions_enums_and_all_of():
    s = Schema(RICH, "p")
    node = lambda name: s.node(f"/properties/{name}")  # noqa: E731
    assert s.is_string(node("code")) and s.is_string(node("unit"))
    assert s.types(node("city")) == {"object"} and s.types(node("alt")) == {"object", "null"}
    assert s.types(node("note")) == {"string", "null"} and not s.is_string(node("note"))
    assert s.types({"allOf": [{"type": ["string", "integer"]}, {"type": "number"}]}) == {"integer"}
    assert s.types({"const": True}) == {"boolean"} and s.types({}) is None
    recursive = Schema({"$defs": {"N": {"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/$defs/N"}}}}}, "$ref": "#/$defs/N"}, "p")
    assert recursive.types(recursive.root) == {"object"}
    assert [k for k, _ in recursive.object_view()[0]] == ["kids"]


@pytest.mark.parametrize("schema, text, value", [
    ({"type": "string"}, " 42 ", " 42 "),  # a plain string is the text, whitespace and all
    ({"enum": ["a", "b"]}, "a", "a"),
    ({"type": "integer"}, "42", 42),
    ({"type": "number"}, "42", 42),
    ({"type": "boolean"}, "True", True),  # as Python writes it
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null", None),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "sk-123", "sk-123"),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "42", "42"),  # 42 is no admitted type: the text
    ({"type": ["string", "integer"]}, "7", 7),
    ({"$ref": "#/$defs/City"}, '{"name": "Paris", "country": "FR"}', {"name": "Paris", "country": "FR"}),
    ({}, "Paris", "Paris"), ({}, "[1, 2]", [1, 2]),
])
def test_values_are_typed_by_the_schema(schema, text, value):
    s = Schema({"$defs": {"City": CITY}, "properties": {"x": schema}}, "p")
    got = s.value(text, s.node("/properties/x"))
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("bad, keyword", [
    ({"type": "string", "minLength": "abc"}, "x.minLength"),
    ({"type": "string", "maxLength": -1}, "x.maxLength"),
    ({"type": "number", "maximum": float("inf")}, "x.maximum"),  # what JSON's 1e400 reads as
    ({"type": "number", "minimum": float("nan")}, "x.minimum"),
    ({"type": "integer", "multipleOf": 0}, "x.multipleOf"),
    ({"type": "strin"}, "x.type"),
    ({"enum": []}, "x.enum"),
    ({"type": "object", "required": [1]}, "x.required"),
    ({"anyOf": {"type": "string"}}, "x.anyOf"),
    ({"$ref": "https://example.com/s.json"}, "x.$ref"),
    ({"$ref": "#/$defs/missing"}, "x.$ref"),
    ({"type": "string", "pattern": 5}, "x.pattern"),
    ("string", "x"),
])
def test_unusable_keywords_are_a_400_naming_them(tok, bad, keyword):
    params = {"type": "object", "properties": {"x": bad}}
    for kw, where in ((dict(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
                            tool_choice="auto"), "tools[0].function.parameters.properties."),
                      (dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": params}}),
                       "response_format.json_schema.schema.properties.")):
        with pytest.raises(APIError) as err:
            request_grammar(request(**kw), tok, thinking=False)
        assert err.value.status == 400 and err.value.param == where + keyword
        assert err.value.message.startswith(where + keyword) and "\n" not in err.value.message


def test_schemas_too_deep_or_too_large_are_refused():
    deep = {"type": "string"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaError, match="nested too deeply"):
        Schema(deep, "p")
    with pytest.raises(SchemaError, match="too large"):
        Schema({"anyOf": [{"type": "null"}] * 30_000}, "p")


def test_compile_errors_are_one_line_without_a_backtrace(grammars, tok, monkeypatch):
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    for schema in ({"type": "integer", "minimum": 1e300}, {"type": "string", "pattern": "(?<=a)b"}):
        params = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
        grammar = request_grammar(request(tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
                                          tool_choice="required"), tok, thinking=False)
        for compile_ in (grammars.check, grammars.matcher):
            with pytest.raises(GrammarError) as err:
                compile_(grammar)
            message = str(err.value)
            assert "\n" not in message and "backtrace" not in message.lower() and " | " not in message
            assert message.startswith("the output constraint does not compile:") and len(message) < 500


# ---- what the grammar admits ------------------------------------------------------------------------
def test_tool_grammar_enforces_the_schema(grammars, tok):
    grammar = request_grammar(request(tools=[TOOL], tool_choice="required"), tok, thinking=False)
    base = [("code", "Paris"), ("city", '{"name":"Paris","country":"FR"}'), ("days", "3"), ("unit", "C")]
    ok = lambda pairs: accepts(grammars, tok, grammar, glm_call("forecast", pairs))  # noqa: E731
    assert ok(base)
    assert ok(base[:2] + [("alt", "null")] + base[2:] + [("note", '"windy"'), ("tags", '["a","b"]')])
    assert ok(base[:2] + [("alt", '{"name":"Lyon","country":"FR"}')] + base[2:] + [("note", "null")])
    bad = {
        "pattern": [("code", "paris")] + base[1:],
        "string too long": [("code", "Parisssssssss")] + base[1:],
        "whitespace in JSON": [base[0], ("city", '{"name": "Paris", "country": "FR"}')] + base[2:],
        "undeclared key": [base[0], ("city", '{"name":"Paris","country":"FR","x":1}')] + base[2:],
        "enum": [base[0], ("city", '{"name":"Paris","country":"US"}')] + base[2:],
        "maximum": base[:2] + [("days", "15")] + base[3:],
        "integer digits beyond the bound": base[:2] + [("days", "140")] + base[3:],
        "missing required": base[:3],
        "maxItems": base + [("tags", '["a","b","c","d"]')],
        "optional string written raw": base + [("note", "windy")],
    }
    for why, pairs in bad.items():
        assert not ok(pairs), why


def test_required_allows_parallel_calls_a_named_choice_exactly_one(grammars, tok):
    two = glm_call("now", []) * 2
    clock = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    required = request_grammar(request(tools=[clock], tool_choice="required"), tok, thinking=False)
    named = request_grammar(request(tools=[clock], tool_choice={"type": "function", "function": {"name": "now"}}),
                            tok, thinking=False)
    assert accepts(grammars, tok, required, two) and accepts(grammars, tok, named, glm_call("now", []))
    assert not accepts(grammars, tok, named, two)


def test_thinking_modes_in_the_grammar(grammars, tok):
    """open: reasoning, </think>, the answer; optional (the model may open it): with or without a block."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 9}}, "required": ["n"]}}}
    grammar = {mode: request_grammar(request(response_format=fmt), tok, thinking=mode)
               for mode in ("open", "optional", "off")}
    cases = {"plan</think>{\"n\":1}": {"open"}, '{"n":1}': {"optional", "off"},
             '\n<think>plan</think>{"n":1}': {"optional"}, '<think>plan</think>{"n":1}': {"optional"}}
    for text, modes in cases.items():
        for mode, g in grammar.items():
            assert accepts(grammars, tok, g, text) == (mode in modes), (text, mode)


def test_json_layout_compact_by_default_flexible_on_request(grammars, tok):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    spaced, tight = '{"name": "Paris", "country": "FR"}', '{"name":"Paris","country":"FR"}'
    compact = request_grammar(request(response_format=rf), tok, thinking=False)
    assert accepts(grammars, tok, compact, tight) and not accepts(grammars, tok, compact, spaced)
    for so in ({"disable_any_whitespace": False}, {"whitespace_pattern": "[ ]?"}):
        req = request(response_format=rf, structured_outputs=so)
        flexible = request_grammar(req, tok, thinking=False, layout=json_layout(req))
        assert accepts(grammars, tok, flexible, spaced) and accepts(grammars, tok, flexible, tight)
    server_default = request_grammar(request(response_format=rf), tok, thinking=False,
                                     layout=json_layout(request(response_format=rf), "flexible"))
    assert accepts(grammars, tok, server_default, spaced)
    with pytest.raises(Exception, match="json"):  # vLLM's constraint keys are not taken here: response_format is
        request(response_format=rf, structured_outputs={"json": CITY})


# ---- a random model under the grammar ends, valid --------------------------------------------------
@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine.from_pretrained(checkpoint, EngineConfig(num_kv_blocks=128, max_num_seqs=8))


def generate(engine, req, n=6, max_tokens=300):
    tok = engine.tokenizer
    grammar = request_grammar(req, tok, thinking=False)
    prompt = tok.apply_chat_template(req.template_messages(), tools=req.template_tools(), tokenize=True,
                                     enable_thinking=False)
    engine.add_request(prompt, SamplingParams(n=n, seed=7, temperature=1.0, max_tokens=max_tokens, grammar=grammar,
                                              stop_token_ids=set(tok.stop_ids)))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
    return final.outputs


def test_random_model_json_ends_valid(engine):
    rf = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": RICH}}
    for out in generate(engine, request(response_format=rf)):
        assert out.finish_reason == "stop", out.text[-200:]
        jsonschema.validate(json.loads(out.text), RICH)


def test_random_model_tool_call_ends_valid_and_typed(engine):
    req = request(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    for out in generate(engine, req):
        assert out.finish_reason == "stop", out.text[-200:]
        parser = ChatOutputParser(False, req.template_tools())
        parser.feed(out.text)
        parser.finish()
        (call,) = parser.calls
        args = json.loads(call.arguments)
        jsonschema.validate(args, RICH)
        assert isinstance(args["city"], dict) and isinstance(args["days"], int)


# ---- through HTTP: a raw body, as a client sends it -----------------------------------------------
def test_http_400_names_the_keyword(start_server):
    import httpx

    url, _ = start_server(max_model_len=512, num_kv_blocks=64)
    bodies = {  # 1e400 is valid JSON that Python reads as infinity
        '"maxLength": 1e400': "tools[0].function.parameters.properties.x.maxLength",
        '"minLength": "abc"': "tools[0].function.parameters.properties.x.minLength",
    }
    for keyword, param in bodies.items():
        body = ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto", '
                '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
                '"properties": {"x": {"type": "string", ' + keyword + '}}}}}]}')
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "\n" not in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-test", "messages": ASK, "structured_outputs": {"regex": "a+"}})
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["param"]
