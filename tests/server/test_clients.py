"""The client matrix: the libraries people point at an OpenAI-compatible server (pinned in the `test` extra),
against `openglm serve` (the real CLI, a subprocess) on a random-weight checkpoint with its defaults
(thinking on, no thinking budget set, compact JSON), each cell with thinking on and off. Every forced
structure must come back as a valid instance of a pydantic model with a nested model, an Optional, Literals
and a bounded int and str (tool arguments: valid against the tool's JSON schema). The grammar forces the
structure whatever the random model samples; with thinking on, the server's default for a constrained
answer (reason for at most half of `max_tokens`) forces `</think>` so that the structure always has room;
bounded fields and compact JSON make it end. json_mode forces only "a JSON object", which a random model
may never close: that cell runs on a model scripted to write one (conftest.py's `scripted`, the same app).
Thinking off is Z.ai's `thinking: {"type": "disabled"}` (openai-agents: its own setting, reasoning effort
"none"). One server for the module; every request is seeded, so each cell is deterministic."""

import asyncio
import json
import os
from typing import Annotated, Literal, Optional

import jsonschema
import pytest
from pydantic import BaseModel, Field
from testutil import openglm_serve

MODEL, KEY = "tiny-clients", "client-key"
ASK = "What is the forecast for Paris?"
THINKING = {"on": {}, "off": {"thinking": {"type": "disabled"}}}
# thinking on: the reasoning of a constrained answer ends after half of max_tokens; the other half holds the
# structure even where the random model fills each bounded string with 4-byte characters (about 220 tokens)
MAX_TOKENS = 480
SAMPLING = dict(max_tokens=MAX_TOKENS, seed=11, temperature=1.0)


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["FR", "DE", "JP"]


class Forecast(BaseModel):
    city: City
    alternative: Optional[City] = None
    days: int = Field(ge=1, le=14)
    unit: Literal["C", "F"]
    note: Optional[str] = Field(default=None, max_length=20)


class Notes(BaseModel):
    """For json_mode, which forces only "a JSON object" (the schema is the client's to check)."""
    summary: Optional[str] = None
    tags: Optional[list[str]] = None


FORECAST_TOOL = {"type": "function", "function": {"name": "forecast", "description": "Report a forecast",
                                                  "parameters": Forecast.model_json_schema()}}


@pytest.fixture(scope="module")
def served(checkpoint):
    """`openglm serve` as a user starts it (defaults: thinking on, no thinking budget, compact JSON) with an API
    key."""
    with openglm_serve(checkpoint, "--served-model-name", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "512",
                       "--threads", "1", "--log-level", "warning",
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENGLM_API_KEY": KEY}) as url:
        yield f"{url}/v1"


def openai_client(url, async_=False):
    from openai import AsyncOpenAI, OpenAI

    return (AsyncOpenAI if async_ else OpenAI)(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def valid_arguments(arguments, tool=FORECAST_TOOL) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


# ---- openai ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", THINKING)
def test_openai_parse_nested_optional_model(served, thinking):
    out = openai_client(served).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": ASK}], response_format=Forecast,
        extra_body=THINKING[thinking], **SAMPLING)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Forecast)
    assert bool((choice.message.model_extra or {}).get("reasoning_content")) == (thinking == "on")


@pytest.mark.parametrize("thinking", THINKING)
def test_openai_responses_with_a_function_tool(served, thinking):
    tool = {"type": "function", "name": "forecast", "parameters": Forecast.model_json_schema()}
    out = openai_client(served).responses.create(
        model=MODEL, input=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=MAX_TOKENS,
        extra_body={"seed": 11, **THINKING[thinking]})
    calls = [item for item in out.output if item.type == "function_call"]
    assert out.status == "completed" and calls and all(c.name == "forecast" for c in calls)
    for call in calls:
        valid_arguments(call.arguments)
    assert (out.output[0].type == "reasoning") == (thinking == "on")


# ---- langchain-openai -----------------------------------------------------------------------------------
def chat_openai(served, thinking):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=served, api_key=KEY, max_retries=0, extra_body=THINKING[thinking],
                      **SAMPLING)


@pytest.mark.parametrize("thinking", THINKING)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served, method, thinking):
    llm = chat_openai(served, thinking)
    assert isinstance(llm.with_structured_output(Forecast, method=method).invoke(ASK), Forecast)


@pytest.mark.parametrize("thinking", THINKING)
def test_langchain_json_mode(scripted, thinking):
    """json_mode (`response_format: json_object`) on a model scripted to reason (thinking on) and write a JSON
    object: the object arrives as the content, the reasoning apart from it."""
    from langchain_openai import ChatOpenAI

    client, reply = scripted
    answer = '{"summary":"sunny","tags":["warm","dry"]}'  # compact: the server's default JSON layout
    reply(("The user wants JSON.</think>" if thinking == "on" else "") + answer)
    llm = ChatOpenAI(model="tiny-test", base_url=str(client.base_url), api_key="unused", max_retries=0,
                     extra_body=THINKING[thinking], **SAMPLING)
    out = llm.with_structured_output(Notes, method="json_mode", include_raw=True).invoke(ASK + " Answer in JSON.")
    assert out["parsing_error"] is None and out["parsed"] == Notes(summary="sunny", tags=["warm", "dry"])
    assert out["raw"].content == answer and out["raw"].response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("thinking", THINKING)
def test_langchain_bind_tools(served, thinking):
    message = chat_openai(served, thinking).bind_tools([FORECAST_TOOL], tool_choice="required").invoke(ASK)
    assert message.tool_calls and all(call["name"] == "forecast" for call in message.tool_calls)
    for call in message.tool_calls:
        valid_arguments(call["args"])


# ---- litellm ---------------------------------------------------------------------------------------------
def litellm_completion(served, thinking, **kw):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm  # after the variable above: it is read at import

    return litellm.completion(model=f"openai/{MODEL}", api_base=served, api_key=KEY,
                              messages=[{"role": "user", "content": ASK}], extra_body=THINKING[thinking],
                              **SAMPLING, **kw)


@pytest.mark.parametrize("thinking", THINKING)
def test_litellm_json_schema(served, thinking):
    out = litellm_completion(served, thinking, response_format=Forecast)
    assert out.choices[0].finish_reason == "stop"
    Forecast.model_validate_json(out.choices[0].message.content)


@pytest.mark.parametrize("thinking", THINKING)
def test_litellm_forced_tools(served, thinking):
    out = litellm_completion(served, thinking, tools=[FORECAST_TOOL],
                             tool_choice={"type": "function", "function": {"name": "forecast"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "forecast"
        valid_arguments(call.function.arguments)


# ---- instructor ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", THINKING)
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(served, mode, thinking):
    import instructor

    client = instructor.from_openai(openai_client(served), mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                         response_model=Forecast, max_retries=0, extra_body=THINKING[thinking],
                                         **SAMPLING)
    assert isinstance(out, Forecast)


# ---- openai-agents ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", THINKING)
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_agent_with_a_function_tool(served, api, thinking):
    """An Agent whose first turn must call its tool and whose answer is a Forecast: through the default
    provider's Responses model, and through OpenAIChatCompletionsModel."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from agents.items import ToolCallItem
    from agents.models.openai_provider import OpenAIProvider
    from openai.types.shared import Reasoning

    asked = []

    @function_tool
    def lookup(city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=14)]) -> str:
        """The weather service (bounded arguments: a random model's unbounded string would never end)."""
        asked.append((city, days))
        return "sunny, 21 C"

    client = openai_client(served, async_=True)
    # thinking off through the agents' own setting: `reasoning_effort` / `reasoning.effort` "none"
    settings = ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, extra_body={"seed": 11},
                             reasoning=Reasoning(effort="none") if thinking == "off" else None)
    model = OpenAIChatCompletionsModel(MODEL, client) if api == "chat_completions" else MODEL
    agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[lookup], output_type=Forecast,
                  model=model, model_settings=settings)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True), tracing_disabled=True)
    result = asyncio.run(Runner.run(agent, ASK, run_config=config, max_turns=3))
    assert isinstance(result.final_output, Forecast)
    assert asked and any(isinstance(item, ToolCallItem) for item in result.new_items)
    reasoned = any(item.type == "reasoning" for response in result.raw_responses for item in response.output)
    assert reasoned == (thinking == "on")
