"""The attacks on `openglm serve` of the second hostile-input review, a test each (named after the attack; each
failed on the code before the fix). Where an attack is a denial of service, a benign client is served meanwhile:
the bounds are generous for a loaded 2-core CI machine; the tight figures are benchmarks/bench_abuse.py's."""

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import requests
from testutil import closed_by_server, free_port, wait_healthy

from openglm.server.limits import ServerLimits
from openglm.tokenizer import CHAT_TEMPLATE

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
MODEL = "tiny-test"

# A checkpoint's template with four traps, sprung by the first message's text; any other conversation renders
# as openglm's own template does. LOOP loops 10^10 times without calling anything (only a timer stops it).
HOSTILE_TEMPLATE = (
    "{%- if messages[0].content == 'LOOP' -%}{%- set xs = range(100000)|list -%}"
    "{%- for a in xs -%}{%- for b in xs -%}{%- endfor -%}{%- endfor -%}{%- endif -%}"
    "{%- if messages[0].content == 'BIG' -%}{%- for i in range(100000) -%}{%- for j in range(3) -%}{{ 'x' * 1000 }}"
    "{%- endfor -%}{%- endfor -%}{%- endif -%}"
    "{%- if messages[0].content == 'RANGE' -%}{{ range(10 ** 9)|length }}{%- endif -%}"
    "{%- if messages[0].content == 'REPEAT' -%}{{ 'x' * 10 ** 10 }}{%- endif -%}\n") + CHAT_TEMPLATE


def chat(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **kw}


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    return resp.json()["error"]


def optional_properties(n: int) -> dict:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
    return {"type": "json_schema", "json_schema": {"name": "many", "schema": schema}}


@contextlib.contextmanager
def serve(checkpoint, *args):
    """`openglm serve` (the real CLI, a subprocess, no key: loopback): (base URL, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openglm", "serve", str(checkpoint), "--port", str(port),
                             "--served-model-name", MODEL, "--threads", "1", "--log-level", "warning", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items() if k != "OPENGLM_API_KEY"}
                            | {"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def hostile(checkpoint, tmp_path_factory):
    """A server whose checkpoint carries the hostile template: template budget 1 s, grammar budget 2 s."""
    ckpt = tmp_path_factory.mktemp("hostile") / "tiny"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    with serve(ckpt, "--max-model-len", "256", "--num-kv-blocks", "96", "--template-timeout", "1",
               "--grammar-timeout", "2", "--prepare-workers", "2") as served:
        yield served


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024


async def timed(coro):
    t0 = time.monotonic()
    resp = await coro
    return resp, time.monotonic() - t0


# ---- templates ------------------------------------------------------------------------------------------
def test_a_template_that_loops_10_10_times_is_a_400_and_others_are_served(hostile):
    url, proc = hostile

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            bad = [asyncio.create_task(c.post(CHAT, json=chat("LOOP"))) for _ in range(2)]
            await asyncio.sleep(0.3)  # both workers are in the loop now
            good = await asyncio.gather(timed(c.post(CHAT, json=chat("hello"))),
                                        timed(c.post(CMPL, json={"model": MODEL, "prompt": "def f():",
                                                                 "max_tokens": 4})))
            return await asyncio.gather(*bad), good

    bad, good = asyncio.run(run())
    for resp in bad:
        assert "ran longer than its limit of 1 s" in error_of(resp, 400)["message"]
    for resp, seconds in good:  # before: no answer while the template ran (hours)
        assert resp.status_code == 200 and seconds < 30, (resp.text[:200], seconds)
    assert proc.poll() is None


def test_a_template_that_renders_300_mb_is_a_400_and_the_server_lives(hostile):
    url, proc = hostile
    err = error_of(httpx.post(f"{url}{CHAT}", json=chat("BIG"), timeout=60), 400)
    assert err["code"] == "context_length_exceeded" and "256 tokens" in err["message"]
    assert proc.poll() is None and httpx.post(f"{url}{CHAT}", json=chat("hi"), timeout=60).status_code == 200


@pytest.mark.parametrize("trap, needle", [("RANGE", "Range too big"), ("REPEAT", "repeated string or list")])
def test_template_range_10_9_and_repeat_10_10_are_400s_naming_the_limit(hostile, trap, needle):
    url, _ = hostile
    err = error_of(httpx.post(f"{url}{CHAT}", json=chat(trap), timeout=60), 400)
    assert needle in err["message"] and "limit" in err["message"] and err["param"] == "messages"


def test_a_client_that_disconnects_frees_the_template_worker(checkpoint):
    """Its render is interrupted: the one worker is free long before the template's 30 s budget would end."""
    from openglm.server.prepare import PrepareError, PrepareWorkers
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(checkpoint)
    tok.chat_template = HOSTILE_TEMPLATE
    workers = PrepareWorkers(tok, tok.vocab_size, 256, ServerLimits(prepare_workers=1, template_timeout_s=30)).start()

    async def run():
        t0 = time.monotonic()

        async def gone():
            return time.monotonic() - t0 > 0.5

        with pytest.raises(PrepareError) as e:
            await workers.chat([{"role": "user", "content": "LOOP"}], None, True, {}, gone)
        assert e.value.cancelled
        ids = await workers.chat([{"role": "user", "content": "hi"}], None, True, {})
        return ids, time.monotonic() - t0

    try:
        ids, seconds = asyncio.run(run())
    finally:
        workers.close()
    assert ids == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert seconds < 15 and workers.restarts == 0  # interrupted, not killed


def test_a_slow_template_job_does_not_hold_up_quick_ones(checkpoint):
    """With one prepare worker busy in a 10^10 loop (its budget 30 s), a benign chat is prepared by a spare started
    in its place while the loop still runs, and the looping worker runs at low CPU priority."""
    from openglm.server.prepare import SLOW_NICE, PrepareWorkers
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(checkpoint)
    tok.chat_template = HOSTILE_TEMPLATE
    workers = PrepareWorkers(tok, tok.vocab_size, 256, ServerLimits(prepare_workers=1, template_timeout_s=30)).start()
    looping = workers._all[0].proc.pid

    async def run():
        left = asyncio.Event()

        async def gone():
            return left.is_set()

        loop = asyncio.create_task(workers.chat([{"role": "user", "content": "LOOP"}], None, True, {}, gone))
        while not workers.idle.empty():  # the loop's job holds the one worker before the chat is sent
            await asyncio.sleep(0.01)
        ids = await workers.chat([{"role": "user", "content": "hi"}], None, True, {})
        still_looping, nice = not loop.done(), os.getpriority(os.PRIO_PROCESS, looping)
        left.set()  # the client leaves: the render is interrupted
        with contextlib.suppress(Exception):
            await loop
        return ids, still_looping, nice

    try:
        ids, still_looping, nice = asyncio.run(run())
    finally:
        workers.close()
    assert ids == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert still_looping and nice == SLOW_NICE  # before: the chat waited for the loop's whole budget
    assert workers.restarts == 0 and workers.spares == 0  # the loop was interrupted; its worker left the pool


# ---- output grammars ------------------------------------------------------------------------------------
def test_schemas_of_10_000_and_12_000_optional_properties_are_one_line_400s_while_a_stream_goes_on(hostile):
    url, _ = hostile
    gaps, health = [], []

    async def stream(c):
        last = time.monotonic()
        async with c.stream("POST", CHAT, json=chat("hello", stream=True, max_tokens=200, ignore_eos=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    async def probe(c, done):
        while not done.is_set():
            t0 = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            health.append(time.monotonic() - t0)
            await asyncio.sleep(0.1)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            done = asyncio.Event()
            watch = [asyncio.create_task(stream(c)), asyncio.create_task(probe(c, done))]
            await asyncio.sleep(0.5)
            bad = await asyncio.gather(*[timed(c.post(CHAT, json=chat("hi", response_format=optional_properties(n))))
                                         for n in (10_000, 12_000)])
            await watch[0]
            done.set()
            await watch[1]
            return bad

    for resp, seconds in asyncio.run(run()):  # before: 27 s of compiling on the event loop, then a Rust panic
        err = error_of(resp, 400)
        assert "within its limit of 2 s" in err["message"] and "\n" not in err["message"]
        assert "backtrace" not in err["message"].lower() and "panicked" not in err["message"]
        assert seconds < 30
    assert max(gaps) < 10 and max(health) < 5, (max(gaps), max(health))  # before: 21.6 s and 5.8 s


def test_n_16_compiles_one_grammar_off_the_engine_thread(start_server):
    url, engine = start_server(num_kv_blocks=128, max_model_len=512)
    grammar = engine.grammar
    real = grammar._llg
    built = []

    class Counting:  # llguidance, with its matcher constructor counted
        def __getattr__(self, name):
            return getattr(real, name)

        def LLMatcher(self, *args, **kw):  # noqa: N802 - llguidance's name
            built.append(threading.current_thread().name)
            return real.LLMatcher(*args, **kw)

    grammar._llg = Counting()
    try:
        resp = httpx.post(f"{url}{CHAT}", timeout=120, json=chat(
            "hi", n=16, max_tokens=8, chat_template_kwargs={"enable_thinking": False},
            response_format=optional_properties(40)))
    finally:
        grammar._llg = real
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 16
    assert len(built) == 1 and built[0] != "openglm-engine", built  # before: 16 compiles in the engine thread


@pytest.mark.parametrize("keyword, value", [("minLength", "abc"), ("maximum", "1e400")])
def test_wrong_typed_schema_keywords_are_400s_naming_the_keyword(http, keyword, value):
    body = json.dumps(chat("hi", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", keyword: "VALUE"}}}}}))
    raw = body.replace('"VALUE"', value if value == "1e400" else json.dumps(value))
    err = error_of(http.post(CHAT, content=raw, headers={"Content-Type": "application/json"}), 400)
    assert keyword in err["param"]


# ---- prompts --------------------------------------------------------------------------------------------
def test_a_4_mb_prompt_is_refused_before_it_is_tokenised(hostile):
    url, proc = hostile
    before = peak_rss_mb(proc.pid)
    huge = "def f(): return 1; " * (4_000_000 // 19)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*[timed(c.post(CMPL, json={"model": MODEL, "prompt": huge})) for _ in range(8)],
                                        timed(c.post(CHAT, json=chat(huge))))

    for resp, seconds in asyncio.run(run()):
        assert error_of(resp, 400)["code"] == "context_length_exceeded" and seconds < 60
    # before: +873 MB for one such request (tokenised whole in the server); now the server parses the bodies only
    assert peak_rss_mb(proc.pid) - before < 250, (before, peak_rss_mb(proc.pid))


def test_a_long_prompt_is_counted_a_window_at_a_time(checkpoint):
    """The worker's check of a text longer than a window: over the context it stops counting early; within it,
    the ids are the tokenizer's own."""
    from openglm.server.prepare_worker import WINDOW_CHARS, Refused, Worker
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(checkpoint)
    init = {"tokenizer": tok.hf.to_str(), "chat_template": tok.chat_template, "eos_token": tok.eos_token,
            "config": tok.config, "model_max_length": tok.model_max_length, "vocab_size": tok.vocab_size,
            "max_model_len": 100_000, "template_timeout_s": 1.0}
    worker = Worker(init)
    source = Path(json.__file__).read_text()
    calls = []
    encode = worker.tokenizer.encode
    worker.tokenizer.encode = lambda text: calls.append(len(text)) or encode(text)
    text = (source * 150)[: worker.max_chars - 1]  # passes the cheap bound, far over 100,000 tokens
    assert len(text) > 8 * WINDOW_CHARS
    with pytest.raises(Refused, match="100000 tokens"):
        worker.text({"text": text})
    assert max(calls) <= WINDOW_CHARS and sum(calls) < len(text) // 2  # stopped early, a window at a time
    fits = (source * 3)[: 2 * WINDOW_CHARS]
    worker.tokenizer.encode = encode
    assert worker.text({"text": fits}) == tok.encode(fits)


# ---- connections ----------------------------------------------------------------------------------------
def test_a_body_trickled_a_byte_at_a_time_times_out_in_total(start_server):
    url, _ = start_server(num_kv_blocks=32, limits=ServerLimits(body_timeout_s=2, min_body_rate=1 << 20))
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=0.25) as s:
        s.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 1000\r\n\r\n".encode())
        t0, head = time.monotonic(), b""
        while time.monotonic() - t0 < 15 and not head:  # a byte every 0.25 s: every gap far below the timeout
            s.sendall(b" ")
            try:
                head = s.recv(100)
            except socket.timeout:
                pass
        seconds = time.monotonic() - t0
    assert head.startswith(b"HTTP/1.1 408"), head  # before: no answer for as long as the trickle went on
    assert seconds < 10


def test_slow_connections_do_not_take_the_places_of_ready_requests(start_server):
    limits = ServerLimits(limit_concurrency=12, max_connections=16, header_timeout_s=60, body_timeout_s=60)
    url, _ = start_server(num_kv_blocks=32, limits=limits)
    host, port = url.removeprefix("http://").split(":")
    slow = []
    try:
        for i in range(24):  # trickled bodies and unfinished heads, more than both limits
            s = socket.create_connection((host, int(port)), timeout=30)
            head = f"POST {CMPL} HTTP/1.1\r\nHost: x\r\n"
            s.sendall((head + "Content-Length: 1000\r\n\r\n{" if i % 2 else head).encode())
            slow.append(s)
        time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=60) as c:  # before: 503 for every benign request
            for _ in range(3):
                resp = c.post(CMPL, json={"model": MODEL, "prompt": "def f():", "max_tokens": 2})
                assert resp.status_code == 200, resp.text
        assert sum(map(closed_by_server, slow)) >= 8  # the ones beyond the cap, the longest-waiting first
    finally:
        for s in slow:
            s.close()


def test_an_11_mb_body_is_a_413_that_urllib_and_requests_read(start_server):
    url, _ = start_server(num_kv_blocks=32, limits=ServerLimits(max_body_bytes=4 << 20))
    body = b'{"model": "tiny-test", "prompt": "' + b"a" * (11 << 20) + b'"}'
    with pytest.raises(urllib.error.HTTPError) as e:  # before: ConnectionResetError / BrokenPipeError
        urllib.request.urlopen(urllib.request.Request(f"{url}{CMPL}", data=body, method="POST",
                                                      headers={"Content-Type": "application/json"}), timeout=60)
    assert e.value.code == 413 and b"request_too_large" in e.value.read()
    resp = requests.post(f"{url}{CMPL}", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{url}/health").status_code == 200


# ---- fairness -------------------------------------------------------------------------------------------
def test_256_prompts_times_n_16_do_not_starve_a_4_token_chat(start_server):
    # a request may hold half the queue: 256 prompts need a queue of 512 (the default, 256, refuses them with 400)
    url, engine = start_server(num_kv_blocks=512, max_num_seqs=16, max_model_len=256,
                               limits=ServerLimits(max_queue=512))
    big = {"model": MODEL, "prompt": [f"p{i}" for i in range(256)], "n": 16, "max_tokens": 64, "ignore_eos": True,
           "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async with c.stream("POST", CMPL, json=big) as hostile:
                assert hostile.status_code == 200
                lines = hostile.aiter_lines()
                await lines.__anext__()  # the 4,096 sequences are queued and running
                resp, seconds = await timed(c.post(CHAT, json=chat("hello", max_tokens=4, ignore_eos=True)))
                waiting = engine.stats().waiting
            return resp, seconds, waiting

    resp, seconds, waiting = asyncio.run(run())
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    assert waiting > 1000 and seconds < 60, (waiting, seconds)  # served while thousands still wait; before: not
    deadline = time.monotonic() + 30  # the stream was left: its 4,096 sequences are aborted
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


# ---- request fields -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, field, value", [
    (CMPL, "best_of", 2), (CMPL, "use_beam_search", True), (CMPL, "suffix", "x"), (CMPL, "logit_bias", {"5": 1}),
    (CHAT, "best_of", 2), (CHAT, "use_beam_search", True),
])
def test_vllm_fields_openglm_does_not_honour_are_400s_naming_them(http, path, field, value):
    body = chat("hi") if path == CHAT else {"model": MODEL, "prompt": "x", "max_tokens": 2}
    err = error_of(http.post(path, json={**body, field: value}), 400)
    assert err["param"] == field and "does not support" in err["message"]


def test_max_completion_tokens_0_is_a_400(http):
    err = error_of(http.post(CHAT, json=chat("hi", max_completion_tokens=0)), 400)
    assert err["param"] == "max_completion_tokens"


def test_an_unknown_field_nested_900_deep_is_a_400(http):
    nested = {"x": 1}
    for _ in range(900):
        nested = {"x": nested}
    for path, body in ((CHAT, chat("hi")), (CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 2})):
        err = error_of(http.post(path, json={**body, "options": nested}), 400)
        assert err["param"] == "options" and "unknown field" in err["message"]
    err = error_of(http.post(CHAT, json=chat("hi", stream_options={"include_usage": True, "x": nested})), 400)
    assert err["param"] == "stream_options.x"
    ok = http.post(CHAT, json=chat("hi", store=False, metadata={"k": "v"}))  # bookkeeping fields: no effect
    assert ok.status_code == 200, ok.text


def test_tokenize_renders_and_tokenises_in_the_prepare_workers(hostile):
    """/tokenize takes the same road as the chat and completion routes: a looping template is a 400 after its
    budget, a 4 MB prompt is refused before it is tokenised, and the server goes on."""
    url, proc = hostile
    err = error_of(httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": "LOOP"}]}, timeout=60), 400)
    assert "ran longer than its limit of 1 s" in err["message"]
    huge = "def f(): return 1; " * (4_000_000 // 19)
    err = error_of(httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": huge}, timeout=60), 400)
    assert err["code"] == "context_length_exceeded"
    ok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "def f():"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["count"] > 0 and proc.poll() is None
