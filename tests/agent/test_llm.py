"""Model access: the OpenAI-compatible client against a real HTTP server, fallback, replay."""

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from testutil import serve_in_thread

from openglm.agent.llm import FallbackModel, ModelError, ModelSpec, ReplayModel, build_model
from openglm.agent.llm.openai_chat import OpenAIChatModel
from openglm.agent.policy import ToolCallingPolicy


@pytest.fixture(scope="module")
def fake_openai():
    app = FastAPI()
    seen = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append({"auth": request.headers.get("authorization"), **body})
        if body["model"] == "broken":
            return JSONResponse({"error": "overloaded"}, status_code=503)
        if body.get("tools"):
            message = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}]}
        else:
            message = {"role": "assistant", "content": "Let me look.\n```bash\nls -la\n```"}
        return {"model": body["model"], "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}}

    url, stop = serve_in_thread(app)
    yield f"{url}/v1", seen
    stop()


def test_openai_client_tool_calls_usage_and_key(fake_openai):
    url, seen = fake_openai
    model = OpenAIChatModel(url, "glm-test", api_key="k-123")
    r = model.query([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "bash"}}])
    assert r.tool_calls[0].name == "bash" and r.tool_calls[0].arguments == {"command": "ls"}
    assert (r.prompt_tokens, r.completion_tokens, r.model) == (42, 7, "glm-test")
    assert seen[-1]["auth"] == "Bearer k-123" and seen[-1]["model"] == "glm-test"


def test_text_only_models_get_bash_blocks_parsed(fake_openai):
    url, _ = fake_openai
    r = OpenAIChatModel(url, "plain", use_tools=False).query([{"role": "user", "content": "hi"}], tools=[{}])
    (call, as_user), = ToolCallingPolicy().actions(r)
    assert call.name == "bash" and call.arguments == {"command": "ls -la"} and as_user


def test_fallback_when_primary_fails(fake_openai):
    url, _ = fake_openai
    model = build_model({"base_url": url, "model": "broken", "fallback": {"base_url": url, "model": "backup"}})
    assert isinstance(model, FallbackModel)
    assert model.query([{"role": "user", "content": "x"}]).model == "backup"
    both_down = FallbackModel(OpenAIChatModel(url, "broken"), OpenAIChatModel("http://127.0.0.1:9", "gone", timeout=2))
    with pytest.raises(ModelError, match="primary failed"):
        both_down.query([{"role": "user", "content": "x"}])


def test_model_spec_from_json_and_back():
    raw = {"base_url": "http://a/v1", "model": "m", "fallback": {"replay": "t.jsonl"}}
    spec = ModelSpec.from_dict(raw)
    assert spec.fallback == ModelSpec(replay="t.jsonl") and spec.to_dict() == raw
    with pytest.raises(ValueError, match="unknown key.*'colour'"):
        ModelSpec.from_dict({"replay": "t.jsonl", "fallback": {"replay": "u.jsonl", "colour": "blue"}})
    with pytest.raises(ValueError, match="needs 'replay' or 'base_url'"):
        build_model(ModelSpec(model="m"))


def test_replay_is_stateless_and_reports_exhaustion(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"content": "a"}\n\n{"content": "b", "tool_calls": [{"name": "view", "arguments": {}}]}\n')
    m = ReplayModel(str(path))
    assert m.query([{"role": "user", "content": "x"}]).content == "a"
    second = m.query([{"role": "assistant", "content": "a"}])
    assert second.content == "b" and second.tool_calls[0].name == "view"
    with pytest.raises(ModelError, match="exhausted"):
        m.query([{"role": "assistant"}] * 2)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="t.jsonl:1"):
        ReplayModel(str(path))
