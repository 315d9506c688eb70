"""Abuse benchmark: benign streaming clients next to a hostile mix, against a real `openglm serve`.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_abuse.py [--seconds 120] [--clients 8]

Loopback only and bounded: one server on 127.0.0.1, a benign-only run (the same-run anchor), then
the same benign clients with a hostile client mixed in (about 10% of requests): out-of-bounds
sampling fields, lone surrogates, 10 MB bodies, slow-loris heads, trickled bodies, streams dropped
mid-way, more prompts than the queue holds, oversized stop_token_ids. It reports benign failures,
benign p50/p99 (abuse vs anchor), /health latency (overall and while a 10 MB body is refused),
KV blocks after the run, and the server's RSS (start, peak, end).
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
from machine import cpu_model  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

KEY = "bench-abuse-key"
HOST = "127.0.0.1"  # loopback only
HUGE = b'{"model": "m", "prompt": "' + b"a" * (10 << 20) + b'"}'  # a 10 MB body
HOSTILE_CONCURRENCY = 16  # hostile requests in flight at most


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "openglm", "serve", str(ckpt), "--host", HOST, "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "512", "--num-kv-blocks", "256", "--threads", str(threads),
           "--max-body-bytes", str(1 << 20), "--header-timeout", "2", "--body-timeout", "2", "--max-queue", "64",
           "--log-level", "error"]
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
        kinds = [self.bad_fields, self.huge_body, self.slow_loris, self.slow_body, self.drop_stream,
                 self.too_many_prompts, self.many_stop_ids]
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
        reader, writer = await asyncio.open_connection(HOST, int(self.url.rsplit(":", 1)[1]))
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"".encode())
        await writer.drain()
        got = await asyncio.wait_for(reader.read(100), timeout=10)
        writer.close()
        return got.split(b"\r\n")[0].decode(errors="replace")[9:12] or "closed"

    async def drop_stream(self, c):
        body = {"model": "m", "stream": True, "max_tokens": 200, "ignore_eos": True,
                "messages": [{"role": "user", "content": "go on forever"}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break  # vanish after the first chunk
        return "dropped"

    async def too_many_prompts(self, c):
        r = await c.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 65, "max_tokens": 1})
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
        port = free_port()
        proc = start_server(ckpt, port, args.threads)
        url = f"http://{HOST}:{port}"
        try:
            anchor, abuse = Run(url, proc.pid), Run(url, proc.pid)
            run_phase(Run(url, proc.pid), 5.0, args.clients, hostile=False)  # warm-up, not reported
            rss_start = rss_mb(proc.pid)
            run_phase(anchor, args.anchor_seconds, args.clients, hostile=False)
            run_phase(abuse, args.seconds, args.clients, hostile=True)
            time.sleep(2.0)  # let aborted streams' blocks come back
            kv_after, rss_end = kv_used(url), rss_mb(proc.pid)
            alive = proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=20)

    p99a, p99b = pct(anchor.latencies, 99), pct(abuse.latencies, 99)
    hostile_total = sum(abuse.hostile.values())
    print(f"\nbench_abuse  CPU: {cpu_model()}  ({os.cpu_count()} cores)  server threads: {args.threads}  "
          f"clients: {args.clients}  anchor {args.anchor_seconds:g} s, abuse {args.seconds:g} s\n")
    print("| run | benign requests | benign failed | benign p50 s | benign p99 s | hostile requests | /health p99 ms | /health max ms |")
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
    print(f"KV blocks in use after the run: {kv_after:g} (idle = 0)   server alive: {alive}")
    print(f"server RSS MB: start {rss_start:.0f}, peak {max(abuse.rss + anchor.rss):.0f}, end {rss_end:.0f}")
    print("\n| hostile request | outcome | count |\n|---|---|---|")
    for (kind, outcome), n in sorted(abuse.hostile.items()):
        print(f"| {kind} | {outcome} | {n} |")
    if abuse.benign_failed:
        print("\nbenign failures (first 5):", *abuse.benign_failed[:5], sep="\n  ")
    if args.json:
        print(json.dumps({"anchor_p99": p99a, "abuse_p99": p99b, "benign_failed": len(abuse.benign_failed),
                          "kv_after": kv_after, "hostile": hostile_total}))
    ok = not abuse.benign_failed and not anchor.benign_failed and p99b <= 2 * p99a and kv_after == 0 and alive
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
