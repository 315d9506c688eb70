"""vLLM's `/tokenize`, `/detokenize` and `/version` against `openglm serve`: the ids are the ones the server
computes for its own endpoints, and the routes sit behind the key."""

import httpx
import pytest

MSG = [{"role": "user", "content": "hi <|user|> there"}]


def check_error(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_a_prompt_round_trips(http):
    out = http.post("/tokenize", json={"model": "tiny-test", "prompt": "def fib(n):", "return_token_strs": True})
    body = out.json()
    assert out.status_code == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
    assert "".join(body["token_strs"]) == "def fib(n):"
    back = http.post("/detokenize", json={"model": "tiny-test", "tokens": body["tokens"]}).json()
    assert back == {"prompt": "def fib(n):"}
    with_bos = http.post("/tokenize", json={"prompt": "def fib(n):", "add_special_tokens": True}).json()
    assert with_bos["count"] == body["count"] + 2 and with_bos["tokens"][2:] == body["tokens"]


def test_messages_give_the_chat_prompt(http):
    """The ids the chat endpoint queues: the template, thinking switches, text that spells a role token as text."""
    on = http.post("/tokenize", json={"messages": MSG}).json()
    off = http.post("/tokenize", json={"messages": MSG, "thinking": {"type": "disabled"},
                                       "return_token_strs": True}).json()
    assert on["count"] == off["count"] and on["tokens"][:-1] == off["tokens"][:-1] != off["tokens"]
    assert off["token_strs"][-1] == "</think>"
    usage = http.post("/v1/chat/completions", json={"model": "tiny-test", "messages": MSG, "max_tokens": 1,
                                                    "thinking": {"type": "disabled"}}).json()["usage"]
    assert usage["prompt_tokens"] == off["count"]
    assert "<|user|>" in "".join(off["token_strs"][4:])  # the user's text, not a second role token


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"model": "other", "prompt": "a"}, None),
    ("/detokenize", {"tokens": [1, -2]}, "tokens.1"),
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
])
def test_bad_requests_name_the_field(http, route, body, param):
    resp = http.post(route, json=body)
    if param is None:
        check_error(resp, 404)
    else:
        assert check_error(resp, 400)["param"] == param


def test_version_and_the_key(server, http):
    assert http.get("/version").json()["version"]
    for route in ("/tokenize", "/detokenize"):
        check_error(httpx.post(f"{server}{route}", json={"prompt": "a"}), 401)
    check_error(httpx.get(f"{server}/version"), 401)
