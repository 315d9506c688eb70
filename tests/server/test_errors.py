"""Every bad input gets its OpenAI-style status, and the server keeps serving afterwards."""

import httpx
import pytest
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

from openglm.server.limits import ServerLimits

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def check_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if status == 400:  # every 400 names what was wrong in `param` ("body" for the body as a whole)
        assert err["param"], err
    if param is not None:
        assert param in err["param"] or param in err["message"]
    return err


def test_malformed_json(http):
    resp = http.post(CHAT, content=b'{"model": "tiny-test", "messages": [',
                     headers={"Content-Type": "application/json"})
    err = check_error(resp, 400, "body")
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    check_error(http.post(CHAT, content=b"[1, 2]", headers={"Content-Type": "application/json"}), 400)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hello"}, "messages"),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": []}, "messages"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
    ({"messages": MSG, "temperature": -0.5}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "n": 0}, "n"),
])
def test_bad_chat_fields_are_400(http, body, param):
    check_error(http.post(CHAT, json={"model": "tiny-test", **body}), 400, param)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body,param,says", [
    ({"logit_bias": {"1": 5}, "bad_words": ["x"]}, "logit_bias", "does not support this field (nor bad_words)"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages.0.content.1", "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content.0", "audio input is not supported"),
    ({"tools": [TOOL, TOOL]}, "tools", "unique"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "no tool"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "none"),
    ({"thinking": {"type": "maybe"}}, "thinking.type", "enabled"),
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, "reasoning_effort", "turns thinking on"),
    ({"chat_template_kwargs": {"enable_thinking": True}, "thinking": {"type": "disabled"}}, "thinking.type",
     "turns thinking off"),
    ({"thinking_token_budget": -1}, "thinking_token_budget", "greater than or equal to 0"),
    ({"chat_template_kwargs": {"reasoning": True}}, "chat_template_kwargs.reasoning", "unknown field"),
])
def test_each_400_names_its_field(http, body, param, says):
    err = check_error(http.post(CHAT, json={"model": "tiny-test", "messages": MSG, **body}), 400)
    assert err["param"] == param and says in err["message"], err


def test_bad_completion_inputs_are_400(http):
    check_error(http.post(CMPL, json={"model": "tiny-test"}), 400, "prompt")
    check_error(http.post(CMPL, json={"model": "tiny-test", "prompt": ""}), 400, "prompt")
    check_error(http.post(CMPL, json={"model": "tiny-test", "prompt": [1, 2, 10**7]}), 400, "prompt")
    check_error(http.post(CMPL, json={"model": "tiny-test", "prompt": "x", "logprobs": 99}), 400, "logprobs")
    check_error(http.post(CMPL, json={"model": "tiny-test", "prompt": "x", "stop": ["a"] * 5}), 400, "stop")


def test_prompt_longer_than_context_is_400(client):
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="tiny-test", prompt=list(range(10, 310)), max_tokens=4)
    assert "context" in str(e.value)
    with pytest.raises(BadRequestError):  # fits alone, but not with the requested output
        client.completions.create(model="tiny-test", prompt=list(range(10, 210)), max_tokens=100)


def test_unknown_model_is_404(client, http):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MSG)
    assert check_error(http.get("/v1/models/gpt-9"), 404)["code"] == "model_not_found"
    check_error(http.get("/v1/no-such-route"), 404)


def test_api_key_is_enforced(server, api_key):
    for key in ("wrong-key",):
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0).models.list()
    err = check_error(httpx.get(f"{server}/v1/models"), 401)
    assert err["type"] == "authentication_error"
    check_error(httpx.post(f"{server}{CHAT}", json={"model": "tiny-test", "messages": MSG}), 401)
    assert httpx.get(f"{server}/health").status_code == 200  # the liveness probe stays open
    check_error(httpx.get(f"{server}/metrics"), 401)  # metrics and the schema need the key
    check_error(httpx.get(f"{server}/openapi.json"), 401)
    assert httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {api_key}"}).status_code == 200
    schema = httpx.get(f"{server}/openapi.json", headers={"Authorization": f"Bearer {api_key}"})
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    for page in ("/docs", "/redoc"):  # the CDN-backed docs pages are off
        assert httpx.get(f"{server}{page}").status_code == 404


def test_server_survives_bad_requests(http, client):
    for _ in range(3):
        http.post(CHAT, content=b"\xff\xfe garbage", headers={"Content-Type": "application/json"})
    out = client.completions.create(model="tiny-test", prompt="ok", max_tokens=2)
    assert len(out.choices) == 1
    assert "openglm_request_errors_total" in http.get("/metrics").text


def test_overload_is_503_with_retry_after(start_server):
    """Requests beyond the queue limit are refused with 503 + Retry-After (a retry can succeed) while
    the others complete."""
    import asyncio

    url, engine = start_server(num_kv_blocks=64, limits=ServerLimits(max_queue=2))

    async def one(c):
        return await c.post("/v1/completions", json={"model": "tiny-test", "prompt": "go", "max_tokens": 40,
                                                       "ignore_eos": True})

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*[one(c) for _ in range(6)])

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2 and 503 in statuses and set(statuses) <= {200, 503}
    limited = next(r for r in responses if r.status_code == 503)
    assert limited.json()["error"]["code"] == "server_busy" and int(limited.headers["retry-after"]) >= 1
    assert httpx.get(f"{url}/health").status_code == 200
