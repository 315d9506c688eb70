"""Abuse benchmark: benign streaming clients next to a hostile mix, against a real `openglm serve`.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_abuse.py [--seconds 120] [--clients 8]

Loopback only and bounded: one server on 127.0.0.1 whose checkpoint carries a hostile chat template (a
10^10-iteration loop behind a trigger), a benign-only run (the same-run anchor), then the same benign
clients with a hostile client mixed in (about 10% of requests): a template that loops, a JSON schema of
10,000 optional properties, a 1 MB prompt, a body trickled a byte at a time, a request of the most prompts
allowed x n=16, out-of-bounds sampling fields, lone surrogates, 10 MB bodies, slow-loris heads, streams
dropped mid-way, more prompts than a request may hold, oversized stop_token_ids. It reports benign
failures, benign p50/p99 (abuse vs anchor), /health latency (overall and while a 10 MB body is refused),
KV blocks after the run, the RSS of the server and of its prepare workers (start, peak, end), what each
hostile request got, and two figures measured in this process: what preparing a chat in a worker
process costs next to preparing it in-process, and the per-step output bookkeeping of one sequence at
1k / 10k / 100k output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from machine import cpu_model  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

KEY = "bench-abuse-key"
HOST = "127.0.0.1"  # loopback only
HUGE = b'{"model": "m", "prompt": "' + b"a" * (10 << 20) + b'"}'  # a 10 MB body
BIG_PROMPT = "def f(): return 1; " * ((1 << 20) // 20)  # a 1 MB prompt (under the bench's 1 MiB body cap)
MAX_QUEUE = 64
HOSTILE_CONCURRENCY = 16  # hostile requests in flight at most
# the checkpoint's template: a trap sprung by the first message, else openglm's own template
LOOP_TRAP = ("{%- if messages[0].content == 'LOOP' -%}{%- set xs = range(100000)|list -%}"
             "{%- for a in xs -%}{%- for b in xs -%}{%- endfor -%}{%- endfor -%}{%- endif -%}\n")
SCHEMA_10K = {"type": "json_schema", "json_schema": {"name": "many", "schema": {
    "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}}}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def workers_rss_mb(pid: int) -> float:
    """The RSS of the server's prepare worker processes together."""
    try:
        return sum(c.memory_info().rss for c in psutil.Process(pid).children()) / (1 << 20)
    except psutil.Error:
        return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "openglm", "serve", str(ckpt), "--host", HOST, "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "512", "--num-kv-blocks", "256", "--threads", str(threads),
           "--max-body-bytes", str(1 << 20), "--header-timeout", "2", "--body-timeout", "2", "--max-queue",
           str(MAX_QUEUE), "--log-level", "error"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OPENGLM_API_KEY": KEY, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("bench_abuse: the server did not start")


class Run:
    def __init__(self, url: str, pid: int):
        self.url, self.pid = url, pid
        self.latencies: list[float] = []
        self.benign_failed: list[str] = []
        self.hostile: Counter = Counter()
        self.health: list[float] = []
        self.health_during_huge: list[float] = []
        self.huge_in_flight = 0
        self.rss: list[float] = []
        self.workers_rss: list[float] = []
        self.benign_done = 0

    # ---- benign: streaming chat, a short answer ---------------------------------------------
    async def benign(self, client: httpx.AsyncClient, stop_at: float, i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            body = {"model": "m", "stream": True, "max_tokens": rng.randint(16, 32), "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"client {i}: write code {rng.random()}"}]}
            t0 = time.perf_counter()
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        self.benign_failed.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    done = False
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"error"' in line:
                            self.benign_failed.append(line[:200])
                        done = done or line == "data: [DONE]"
                    if not done:
                        self.benign_failed.append("stream ended without [DONE]")
                        continue
            except httpx.HTTPError as exc:
                self.benign_failed.append(f"{type(exc).__name__}: {exc}")
                continue
            self.latencies.append(time.perf_counter() - t0)
            self.benign_done += 1

    # ---- hostile: ~1 request per 9 benign ones --------------------------------------------------
    async def hostile_loop(self, client: httpx.AsyncClient, stop_at: float) -> None:
        """Hostile requests run concurrently (slow ones take seconds), at ~1 per 9 benign requests."""
        kinds = [self.template_loop, self.big_schema, self.big_prompt, self.slow_body, self.huge_n, self.bad_fields,
                 self.huge_body, self.slow_loris, self.drop_stream, self.too_many_prompts, self.many_stop_ids]
        in_flight = asyncio.Semaphore(HOSTILE_CONCURRENCY)
        tasks, sent = [], 0

        async def one(kind):
            async with in_flight:
                try:
                    self.hostile[(kind.__name__, await kind(client))] += 1
                except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
                    self.hostile[(kind.__name__, type(exc).__name__)] += 1

        while time.monotonic() < stop_at:
            if sent * 9 > self.benign_done:  # hostile requests: ~10% of all requests
                await asyncio.sleep(0.02)
                continue
            tasks.append(asyncio.create_task(one(kinds[sent % len(kinds)])))
            sent += 1
        await asyncio.gather(*tasks)

    async def template_loop(self, c):
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "LOOP"}],
                                                       "max_tokens": 4})
        return f"{r.status_code} {r.json()['error']['message'][-28:]}" if r.status_code != 200 else "200"

    async def big_schema(self, c):
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 4, "response_format": SCHEMA_10K})
        return f"{r.status_code} {r.json()['error']['message'][-26:]}" if r.status_code != 200 else "200"

    async def big_prompt(self, c):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": BIG_PROMPT, "max_tokens": 4})
        return f"{r.status_code} {r.json()['error'].get('code')}" if r.status_code != 200 else "200"

    async def huge_n(self, c):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": [f"p{i}" for i in range(MAX_QUEUE // 2)],
                                                  "n": 16, "max_tokens": 4, "ignore_eos": True})
        return f"{r.status_code} ({MAX_QUEUE // 2} prompts x n=16)"

    async def bad_fields(self, c):
        field = random.choice([{"seed": 2**64}, {"temperature": 5e-324}, {"repetition_penalty": 1e-300},
                               {"min_p": "0"}, {"repetition_penalty": True}, {"n": 10**6}])
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", **field})
        raw = b'{"model": "m", "prompt": "\\ud800"}'
        r2 = await c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        return f"{r.status_code}/{r2.status_code}"

    async def huge_body(self, c):
        self.huge_in_flight += 1
        try:
            r = await c.post("/v1/completions", content=HUGE, headers={"Content-Type": "application/json"})
            return str(r.status_code)
        except httpx.TransportError:  # refused with 413 and closed while the upload was still going
            return "refused, connection closed mid-upload"
        finally:
            self.huge_in_flight -= 1

    async def slow_loris(self, c):
        reader, writer = await asyncio.open_connection(HOST, int(self.url.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(100), timeout=10)  # b"" when the server closes it
        writer.close()
        return "closed" if got == b"" else "answered"

    async def slow_body(self, c):
        """A body trickled a byte every 0.5 s (every pause well under the timeout) until the server answers."""
        reader, writer = await asyncio.open_connection(HOST, int(self.url.rsplit(":", 1)[1]))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"".encode())
        got, t0 = b"", time.monotonic()
        while not got and time.monotonic() - t0 < 20:
            writer.write(b" ")
            await writer.drain()
            try:
                got = await asyncio.wait_for(reader.read(100), timeout=0.5)
            except asyncio.TimeoutError:
                continue
        writer.close()
        status = got.split(b"\r\n")[0].decode(errors="replace")[9:12] or "no answer"
        return f"{status} after {time.monotonic() - t0:.0f} s"

    async def drop_stream(self, c):
        body = {"model": "m", "stream": True, "max_tokens": 200, "ignore_eos": True,
                "messages": [{"role": "user", "content": "go on forever"}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break  # vanish after the first chunk
        return "dropped"

    async def too_many_prompts(self, c):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": ["a"] * (MAX_QUEUE // 2 + 1),
                                                  "max_tokens": 1})
        return str(r.status_code)

    async def many_stop_ids(self, c):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "stop_token_ids": list(range(50000))})
        return str(r.status_code)

    # ---- probes (own thread, plain client: the benchmark's event loops never delay them) ---------
    def probe(self, stop_at: float) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while time.monotonic() < stop_at:
                huge = self.huge_in_flight > 0
                t0 = time.perf_counter()
                c.get("/health")
                dt = time.perf_counter() - t0
                self.health.append(dt)
                if huge:
                    self.health_during_huge.append(dt)
                self.rss.append(rss_mb(self.pid))
                self.workers_rss.append(workers_rss_mb(self.pid))
                time.sleep(0.05 if huge else 0.1)


async def benign_clients(run: Run, stop_at: float, clients: int) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=run.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                                 limits=limits) as c:
        await asyncio.gather(*[run.benign(c, stop_at, i) for i in range(clients)])


async def hostile_client(run: Run, stop_at: float) -> None:
    async with httpx.AsyncClient(base_url=run.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        await run.hostile_loop(h, stop_at)


def run_phase(run: Run, seconds: float, clients: int, hostile: bool) -> None:
    """Benign clients in this thread's event loop; the hostile client and the probe in their own
    threads, so neither the 10 MB uploads nor the probe's timing share a loop with anything."""
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=run.probe, args=(stop_at,))]
    if hostile:
        threads.append(threading.Thread(target=lambda: asyncio.run(hostile_client(run, stop_at))))
    for t in threads:
        t.start()
    asyncio.run(benign_clients(run, stop_at, clients))
    for t in threads:
        t.join()


def kv_used(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("openglm_kv_blocks_used "))


def prepare_cost(ckpt: Path, rounds: int = 300) -> tuple[float, float]:
    """Median ms to turn a 10-message chat into token ids: in this process, and through a prepare worker."""
    import statistics

    from openglm.server.limits import ServerLimits
    from openglm.server.prepare import PrepareWorkers
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(ckpt)
    chat = [{"role": "system", "content": "You are a helpful assistant. " * 20}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 30} for i in range(9)]
    kwargs = {"enable_thinking": True, "clear_thinking": True}
    workers = PrepareWorkers(tok, tok.vocab_size, 4096, ServerLimits(prepare_workers=1)).start()

    async def through_worker():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await workers.chat(chat, None, True, kwargs)
            times.append(time.perf_counter() - t0)
        return times

    try:
        inproc = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            tok.apply_chat_template(chat, tokenize=True, **kwargs)
            inproc.append(time.perf_counter() - t0)
        worker = asyncio.run(through_worker())
    finally:
        workers.close()
    return 1000 * statistics.median(inproc), 1000 * statistics.median(worker)


def bookkeeping_ms(ckpt: Path, lengths=(1_000, 10_000, 100_000), steps: int = 50) -> dict[int, float]:
    """Median ms of one step's output bookkeeping (append a token: stop checks, text, the output the server
    streams) for one sequence that already holds `length` output tokens."""
    import statistics

    from openglm.engine.postprocess import request_output, update_text
    from openglm.engine.sampling_params import SamplingParams
    from openglm.engine.sequence import Sequence
    from openglm.server.async_engine import RequestStream
    from openglm.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(ckpt)
    rng, out = random.Random(0), {}
    for n in lengths:
        seq = Sequence([5] * 10, SamplingParams(max_tokens=10 ** 7, stop=["\x00never"], logprobs=0))
        tokens = [rng.randrange(300, tok.vocab_size) for _ in range(n + steps)]
        for t in tokens[:n]:
            seq.append_token(t)
            seq.logprobs.append({"token_id": t, "logprob": -1.0, "top": []})
        update_text(seq, tok.decode, final=True)
        request_output("r", [seq], None, tok.decode)
        times = []
        for t in tokens[n:]:
            t0 = time.perf_counter()
            seq.append_token(t)
            seq.logprobs.append({"token_id": t, "logprob": -1.0, "top": []})
            update_text(seq, tok.decode)
            RequestStream.deltas(request_output("r", [seq], None, tok.decode))
            times.append(time.perf_counter() - t0)
        out[n] = 1000 * statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the abuse run, seconds (default: 120)")
    ap.add_argument("--anchor-seconds", type=float, default=60.0,
                    help="length of the benign-only anchor run, seconds (default: 60)")
    ap.add_argument("--clients", type=int, default=8, help="benign streaming clients (default: 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server (default: 1)")
    ap.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = ap.parse_args()

    from openglm.engine.random_checkpoint import build_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_random_checkpoint(Path(tmp) / "tiny", preset="tiny")
        template = ckpt / "chat_template.jinja"
        template.write_text(LOOP_TRAP + template.read_text())
        cost_inproc, cost_worker = prepare_cost(ckpt)
        bookkeeping = bookkeeping_ms(ckpt)
        port = free_port()
        proc = start_server(ckpt, port, args.threads)
        url = f"http://{HOST}:{port}"
        try:
            anchor, abuse = Run(url, proc.pid), Run(url, proc.pid)
            run_phase(Run(url, proc.pid), 5.0, args.clients, hostile=False)  # warm-up, not reported
            rss_start, workers_start = rss_mb(proc.pid), workers_rss_mb(proc.pid)
            run_phase(anchor, args.anchor_seconds, args.clients, hostile=False)
            run_phase(abuse, args.seconds, args.clients, hostile=True)
            time.sleep(2.0)  # let aborted streams' blocks come back
            kv_after, rss_end, workers_end = kv_used(url), rss_mb(proc.pid), workers_rss_mb(proc.pid)
            alive = proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=20)

    p99a, p99b = pct(anchor.latencies, 99), pct(abuse.latencies, 99)
    hostile_total = sum(abuse.hostile.values())
    print(f"\nbench_abuse  CPU: {cpu_model()}  ({os.cpu_count()} cores)  server threads: {args.threads}  "
          f"clients: {args.clients}  anchor {args.anchor_seconds:g} s, abuse {args.seconds:g} s\n")
    print("| run | benign requests | benign failed | benign p50 s | benign p99 s | hostile requests | "
          "/health p99 ms | /health max ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in (("benign only (anchor)", anchor), ("benign + hostile", abuse)):
        print(f"| {name} | {len(r.latencies)} | {len(r.benign_failed)} | {pct(r.latencies, 50):.3f} | "
              f"{pct(r.latencies, 99):.3f} | {sum(r.hostile.values())} | {1000 * pct(r.health, 99):.1f} | "
              f"{1000 * max(r.health or [float('nan')]):.1f} |")
    share = hostile_total / max(1, hostile_total + len(abuse.latencies) + len(abuse.benign_failed))
    print(f"\nhostile share of requests: {100 * share:.1f}%   benign p99 ratio (abuse / anchor): {p99b / p99a:.2f}x "
          f"(target <= 2x)")
    during = abuse.health_during_huge
    print(f"/health while a 10 MB body is refused: {len(during)} probes, max "
          f"{1000 * max(during or [float('nan')]):.1f} ms (target < 100 ms)")
    health_p99 = 1000 * pct(abuse.health, 99)
    print(f"/health p99 under abuse: {health_p99:.1f} ms (target <= 100 ms)")
    print(f"KV blocks in use after the run: {kv_after:g} (idle = 0)   server alive: {alive}")
    print(f"server RSS MB: start {rss_start:.0f}, peak {max(abuse.rss + anchor.rss):.0f}, end {rss_end:.0f}   "
          f"prepare workers (together): start {workers_start:.0f}, peak {max(abuse.workers_rss):.0f}, "
          f"end {workers_end:.0f}")
    print(f"preparing a 10-message chat (render + tokenise): {cost_inproc:.2f} ms in-process, {cost_worker:.2f} ms "
          f"through a prepare worker (median)")
    print("per-step output bookkeeping, one sequence: " + ", ".join(
        f"{n // 1000}k tokens {ms:.3f} ms" for n, ms in bookkeeping.items()) + " (median)")
    print("\n| hostile request | outcome | count |\n|---|---|---|")
    for (kind, outcome), n in sorted(abuse.hostile.items()):
        print(f"| {kind} | {outcome} | {n} |")
    if abuse.benign_failed:
        print("\nbenign failures (first 5):", *abuse.benign_failed[:5], sep="\n  ")
    if args.json:
        print(json.dumps({"anchor_p99": p99a, "abuse_p99": p99b, "benign_failed": len(abuse.benign_failed),
                          "kv_after": kv_after, "hostile": hostile_total}))
    ok = (not abuse.benign_failed and not anchor.benign_failed and p99b <= 2 * p99a and kv_after == 0 and alive
          and health_p99 <= 100)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
