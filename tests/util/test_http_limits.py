"""util.http_limits at the ASGI level: the limits dataclass and BodyLimit with an app's own refusal."""

from __future__ import annotations

import asyncio

import pytest

from openglm.util.http_limits import BodyLimit, HTTPLimits, refuse_json


@pytest.mark.parametrize("field, value", [("min_body_rate", 0), ("max_connections", -1), ("body_timeout_s", True),
                                          ("header_timeout_s", "10")])
def test_a_limit_that_is_not_a_positive_number_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=f"HTTPLimits.{field} must be positive"):
        HTTPLimits(**{field: value})


def request(body: bytes, headers=()):
    scope = {"type": "http", "method": "POST", "headers": list(headers)}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else await asyncio.Event().wait()

    return scope, receive


def run(middleware, body: bytes, headers=()):
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(*request(body, headers), send))
    return sent


def test_each_refusal_goes_through_the_apps_refuse_in_its_format():
    refused = []

    async def refuse(send, status, message):
        refused.append((status, message))
        await refuse_json(send, status, message)

    async def app(scope, receive, send):
        raise AssertionError("a refused request reached the app")

    limit = BodyLimit(app, HTTPLimits(max_body_bytes=10), refuse=refuse)
    sent = run(limit, b"x" * 11)  # no Content-Length: counted as it arrives
    assert refused == [(413, "the request body is larger than this server's limit of 10 bytes")]
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    assert b'"detail"' in sent[1]["body"]
    run(limit, b"", headers=[(b"content-length", b"11")])  # declared: refused before a byte is read
    assert refused[-1][0] == 413


def test_requests_beyond_limit_concurrency_get_503_with_retry_after_and_the_count_returns():
    gate, seen = asyncio.Event(), []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await gate.wait()

    async def main():
        limit = BodyLimit(app, HTTPLimits(limit_concurrency=1))
        sent = []

        async def send(message):
            sent.append(message)

        first = asyncio.create_task(limit(*request(b"one"), send))
        while limit.active == 0:  # until the first is past its body
            await asyncio.sleep(0)
        await limit(*request(b"two"), send)  # the first is still being answered
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        gate.set()
        await first
        assert limit.active == 0
        await limit(*request(b"three"), send)  # room again
        return seen

    assert asyncio.run(main()) == [b"one", b"three"]
