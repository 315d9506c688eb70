"""Hostile clients against a live server: nothing one client sends may harm another."""

import asyncio
import os
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from openglm.server.limits import ServerLimits

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("field,value", [
    ("seed", 18446744073709551616), ("seed", -(2**63) - 1), ("temperature", 5e-324), ("temperature", 0.001),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("repetition_penalty", True), ("min_p", "0"),
    ("temperature", "0.5"), ("top_k", 10**15), ("presence_penalty", False), ("stop_token_ids", list(range(1025))),
    ("stop_token_ids", [-3]), ("stop", ["x" * 2000]), ("user", "u" * 1000), ("n", True),
])
def test_out_of_bounds_sampling_fields_are_400_naming_the_field(http, field, value):
    err = error_of(http.post(CMPL, json={"model": "tiny-test", "prompt": "x", field: value}), 400)
    assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error"
    error_of(http.post(CHAT, json={"model": "tiny-test", "messages": MSG, field: value}), 400)


def test_a_bad_request_never_fails_a_concurrent_one(server, api_key):
    """The issue's repro: these bodies used to fail the engine step, and every stream with it."""
    hostile = [{"seed": 18446744073709551616}, {"temperature": 5e-324}, {"repetition_penalty": 1e-300}]

    async def run():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {api_key}"},
                                     timeout=60) as c:
            benign = [c.post(CMPL, json={"model": "tiny-test", "prompt": "def f():", "max_tokens": 24,
                                         "ignore_eos": True, "temperature": 0}) for _ in range(3)]
            bad = [c.post(CMPL, json={"model": "tiny-test", "prompt": "go", "max_tokens": 8, **h}) for h in hostile]
            return await asyncio.gather(*benign, *bad)

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 3 + [400] * 3
    texts = {r.json()["choices"][0]["text"] for r in responses[:3]}
    assert len(texts) == 1 and all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses[:3])


def test_lone_surrogate_is_400(http):
    for body in (b'{"model": "tiny-test", "prompt": "a\\ud800b"}',
                 b'{"model": "tiny-test", "prompt": ["ok", "\\udfff"]}'):
        err = error_of(http.post(CMPL, content=body, headers={"Content-Type": "application/json"}), 400)
        assert err["param"].startswith("prompt") and "surrogate" in err["message"]
    body = b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\ud83d"}]}'
    err = error_of(http.post(CHAT, content=body, headers={"Content-Type": "application/json"}), 400)
    assert err["param"] == "messages.0.content"


def test_more_prompts_than_the_queue_holds_is_400_not_retryable(start_server):
    url, _ = start_server(num_kv_blocks=64, limits=ServerLimits(max_queue=8))  # a request may hold half of it
    resp = httpx.post(f"{url}{CMPL}", json={"model": "tiny-test", "prompt": ["a"] * 5, "max_tokens": 1}, timeout=30)
    err = error_of(resp, 400)
    assert err["param"] == "prompt" and "retry-after" not in resp.headers
    assert httpx.post(f"{url}{CMPL}", json={"model": "tiny-test", "prompt": ["a"] * 4, "max_tokens": 1},
                      timeout=30).status_code == 200


def test_one_failing_sequence_fails_its_request_alone(start_server):
    """A fault injected into one sequence of a running batch: that request gets a 500, the
    concurrent ones complete normally and the server keeps serving."""
    url, engine = start_server(num_kv_blocks=64)
    real_run = engine.runner.run
    poison = engine.tokenizer.encode("POISON")

    def run(seqs, num_tokens):
        if any(s.token_ids[: len(poison)] == poison and s.num_output_tokens >= 2 for s in seqs) and len(seqs) > 1:
            raise RuntimeError("injected fault")  # only in a shared batch: the one-by-one retry finds the culprit
        if any(s.token_ids[: len(poison)] == poison and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("injected fault (alone)")
        return real_run(seqs, num_tokens)

    engine.runner.run = run

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            good = [c.post(CMPL, json={"model": "tiny-test", "prompt": f"def f{i}():", "max_tokens": 16,
                                       "ignore_eos": True}) for i in range(3)]
            bad = c.post(CMPL, json={"model": "tiny-test", "prompt": "POISON", "max_tokens": 16, "ignore_eos": True})
            return await asyncio.gather(*good, bad)

    try:
        *good, bad = asyncio.run(burst())
    finally:
        engine.runner.run = real_run
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16 for r in good)
    assert "injected fault" in error_of(bad, 500)["message"]
    deadline = time.monotonic() + 10
    while engine.block_manager.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.block_manager.num_used_blocks == 0
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_huge_body_is_413_and_health_stays_fast(start_server):
    url, _ = start_server(num_kv_blocks=32, limits=ServerLimits(max_body_bytes=1 << 20))
    huge = b'{"model": "tiny-test", "prompt": "' + b"a" * (10 << 20) + b'"}'
    result = {}

    def send():
        try:
            result["resp"] = httpx.post(f"{url}{CMPL}", content=huge, headers={"Content-Type": "application/json"},
                                        timeout=60)
        except httpx.HTTPError as exc:  # the server may close while the rest of the body is still in flight
            result["resp"] = exc

    t = threading.Thread(target=send)
    latencies = []
    with httpx.Client(base_url=url, timeout=15) as probe:
        t.start()
        while t.is_alive() or len(latencies) < 5:
            t0 = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    t.join()
    # the repro stalled /health for 12.7 s: the bound is half of that, far above what a loaded 2-core test machine
    # adds (2 s was seen to fail there); the < 100 ms figure is measured by benchmarks/bench_abuse.py
    assert max(latencies) < 6.0, latencies
    resp = result["resp"]
    if isinstance(resp, httpx.Response):
        assert error_of(resp, 413)["code"] == "request_too_large"

    # no Content-Length: counted as it arrives
    assert chunked_upload_status(url, chunks=40, chunk_bytes=64 << 10) == 413


def chunked_upload_status(url: str, chunks: int, chunk_bytes: int) -> int:
    """The status a server answers to a chunked POST, sending chunks only until it answers: a client that
    went on writing after the server's early 413 and close could see a reset instead of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(chunks):
            if select.select([s], [], [], 0.01)[0]:  # answered (or closed): stop sending
                break
            s.sendall(f"{chunk_bytes:x}\r\n".encode() + b"a" * chunk_bytes + b"\r\n")
        else:
            s.sendall(b"0\r\n\r\n")
        head = s.recv(64).decode(errors="replace")
    assert head.startswith("HTTP/1.1 "), head
    return int(head.split()[1])


def test_slow_clients_are_timed_out(start_server):
    url, _ = start_server(num_kv_blocks=32, limits=ServerLimits(header_timeout_s=0.5, body_timeout_s=0.5))
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:  # slow-loris: a head that never ends
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert s.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
    with socket.create_connection((host, int(port)), timeout=5) as s:  # a body that stops arriving
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        assert b" 408 " in s.recv(1000).split(b"\r\n")[0] + b" "
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_can_be_public_and_an_empty_key_is_refused(start_server, checkpoint):
    url, _ = start_server(num_kv_blocks=32, app_kw={"api_key": "k3y", "public_metrics": True})
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401
    from openglm.server.app import create_app

    with pytest.raises(ValueError, match="empty"):
        create_app(None, "m", api_key="")


def serve_cli(checkpoint, *args, env=None):
    env = {k: v for k, v in os.environ.items() if k != "OPENGLM_API_KEY"} | (env or {})
    return subprocess.run([sys.executable, "-m", "openglm", "serve", str(checkpoint), "--port", "1", *args],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("args,env,needle", [
    (["--host", "0.0.0.0"], {}, "without an API key"),
    (["--api-key", "s3cret"], {}, "--api-key-file"),
    ([], {"OPENGLM_API_KEY": ""}, "empty"),
    (["--api-key-file", "/nonexistent/key"], {}, "cannot read"),
])
def test_cli_refuses_unsafe_key_setups_in_one_line(checkpoint, args, env, needle):
    proc = serve_cli(checkpoint, *args, env=env)
    assert proc.returncode == 2 and needle in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "s3cret" not in proc.stderr


def test_cli_reads_the_key_from_a_file_and_keeps_it_out_of_argv(checkpoint, tmp_path):
    from testutil import free_port

    key_file = tmp_path / "key"
    key_file.write_text("file-key-42\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OPENGLM_API_KEY"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "openglm", "serve", str(checkpoint), "--port", str(port),
                             "--api-key-file", str(key_file), "--num-kv-blocks", "32", "--threads", "1",
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer file-key-42"}).status_code == 200
        assert b"file-key-42" not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    finally:
        proc.terminate()
        proc.wait(timeout=15)
