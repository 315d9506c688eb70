"""Many clients at once, clients that vanish mid-request, and the metrics that show it."""

import asyncio
import time

import httpx
import pytest

from openglm.engine import LLM, SamplingParams

N_CLIENTS = 32
MAX_TOKENS = 16


def wait_until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_32_concurrent_streaming_clients_get_correct_text(async_client, checkpoint, server, metric):
    prompts = [f"item_{i} = compute({i}, " for i in range(N_CLIENTS)]
    offline = LLM(str(checkpoint), num_kv_blocks=96)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]

    async def one(prompt):
        stream = await async_client.completions.create(
            model="tiny-test", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage

    async def everyone():
        return await asyncio.gather(*[one(p) for p in prompts])

    results = asyncio.run(everyone())
    assert [t for t, _ in results] == expected
    assert all(u.completion_tokens == MAX_TOKENS for _, u in results)
    assert wait_until(lambda: metric(server, "openglm_kv_blocks_used") == 0)


def test_stream_disconnect_aborts_and_frees_blocks(server, http, metric):
    before = metric(server, 'openglm_requests_total{finish_reason="abort"}') if _has_abort(server) else 0.0
    body = {"model": "tiny-test", "prompt": "while True:", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 6:
                break  # leave mid-stream: the connection closes here
    assert wait_until(lambda: metric(server, "openglm_requests_running") == 0)
    assert wait_until(lambda: metric(server, "openglm_kv_blocks_used") == 0)
    assert metric(server, 'openglm_requests_total{finish_reason="abort"}') == before + 1


def test_non_stream_disconnect_aborts(server, metric):
    before = metric(server, 'openglm_requests_total{finish_reason="abort"}') if _has_abort(server) else 0.0
    with pytest.raises(httpx.TimeoutException):
        # 16 x 250 tokens: several seconds of work even on an idle machine, the client leaves after 0.3 s
        httpx.post(f"{server}/v1/completions", timeout=0.3, headers={"Authorization": "Bearer test-key-123"},
                   json={"model": "tiny-test", "prompt": "x", "max_tokens": 250, "n": 16, "ignore_eos": True})
    assert wait_until(lambda: metric(server, 'openglm_requests_total{finish_reason="abort"}') == before + 1)
    assert wait_until(lambda: metric(server, "openglm_kv_blocks_used") == 0)


def _has_abort(url):
    return 'finish_reason="abort"' in httpx.get(f"{url}/metrics").text


def test_metrics_exposes_engine_state(server, http, metric):
    http.post("/v1/completions", json={"model": "tiny-test", "prompt": "a", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("openglm_requests_running", "openglm_requests_waiting", "openglm_kv_blocks_used",
                 "openglm_kv_blocks_total", "openglm_generation_tokens_per_second",
                 "openglm_time_to_first_token_seconds_bucket", "openglm_generation_tokens_total",
                 "openglm_prefix_cache_hit_blocks"):
        assert name in text, name
    assert metric(server, "openglm_kv_blocks_total") == 96
    assert metric(server, "openglm_time_to_first_token_seconds_count") >= 1
