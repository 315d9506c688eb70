"""The client matrix: the libraries people point at an OpenAI-compatible server (pinned in the `test` extra),
against `openglm serve` (the real CLI, a subprocess) on a random-weight checkpoint with its defaults
(thinking on). Each forced structure must come back as a valid instance of a pydantic model with a nested
model, an Optional, Literals and a bounded int and str; the grammar forces the structure, so this holds
whatever the random model samples, and bounded fields with compact JSON make it end within max_tokens.

The requests here turn thinking off (`chat_template_kwargs`): with thinking on, a forced structure starts
only once the model closes its reasoning, which a random model does not reliably do within max_tokens;
the thinking-on cells wait for a thinking budget that forces `</think>`. Still to come as well: the
openai SDK's `responses.create`, openai-agents (its default model speaks the Responses API), langchain's
`bind_tools` and json_mode, litellm's forced tools (docs/serving.md, "Client libraries")."""

import os
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field
from testutil import openglm_serve

MODEL, KEY = "tiny-clients", "client-key"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = "What is the forecast for Paris?"
SAMPLING = dict(max_tokens=400, seed=11, temperature=1.0)


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["FR", "DE", "JP"]


class Forecast(BaseModel):
    city: City
    alternative: Optional[City] = None
    days: int = Field(ge=1, le=14)
    unit: Literal["C", "F"]
    note: Optional[str] = Field(default=None, max_length=20)


@pytest.fixture(scope="module")
def served(checkpoint):
    """`openglm serve` as a user starts it (defaults: thinking on, compact JSON), with an API key."""
    with openglm_serve(checkpoint, "--served-model-name", MODEL, "--max-model-len", "2048", "--num-kv-blocks", "512",
                       "--threads", "1", "--log-level", "warning",
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENGLM_API_KEY": KEY}) as url:
        yield f"{url}/v1"


def openai_client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def test_openai_parse_nested_optional_model(served):
    out = openai_client(served).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": ASK}], response_format=Forecast, extra_body=NO_THINK,
        **SAMPLING)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Forecast)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=served, api_key=KEY, max_retries=0, extra_body=NO_THINK, **SAMPLING)
    assert isinstance(llm.with_structured_output(Forecast, method=method).invoke(ASK), Forecast)


def test_litellm_json_schema(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm  # after the variable above: it is read at import

    out = litellm.completion(model=f"openai/{MODEL}", api_base=served, api_key=KEY,
                             messages=[{"role": "user", "content": ASK}], response_format=Forecast,
                             extra_body=NO_THINK, **SAMPLING)
    assert out.choices[0].finish_reason == "stop"
    Forecast.model_validate_json(out.choices[0].message.content)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(served, mode):
    import instructor

    client = instructor.from_openai(openai_client(served), mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                         response_model=Forecast, max_retries=0, extra_body=NO_THINK, **SAMPLING)
    assert isinstance(out, Forecast)
