"""A running `openglm serve` or `openglm agent-server`: /health, /metrics (KV use, queue, preemptions, errors; the
agent-server's store, workers and its tasks' memory growth), and, for a server on this machine, a leak-rate
estimate from its resident memory sampled for a few seconds (Theil-Sen: one spike is not a leak).
"""

from __future__ import annotations

import time
from urllib.parse import urlparse

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from openglm.agent.resilience.leak import theil_sen
from openglm.doctor.report import Check, error, info, ok, warn
from openglm.util.auth import is_loopback

KV_FULL = 0.9  # of the KV pool
LEAK_BYTES_PER_S = (1 << 20) / 60  # 1 MiB a minute, sustained
LEAK_TAU = 0.6  # Kendall tau: the samples must rise as a trend, not as noise
OOM_FIX = ("the write-up's out-of-memory steps, in openglm's flags: paged KV is always on; --block-size 16; "
           "--quantization int8 or fp8 frees weight memory for KV blocks; then more --num-kv-blocks, or fewer "
           "--max-num-seqs")


def check_server(url: str, api_key: str | None = None, watch_s: float = 5.0, timeout: float = 5.0) -> list[Check]:
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(f"{url}/health", timeout=timeout)
    except httpx.HTTPError as e:
        return [error("server.health", f"no answer from {url}/health ({type(e).__name__}: {e})",
                      "is the server running on that address? (`openglm serve` prints its URL at start)")]
    body = _json(health)
    agent = "store" in body
    out = [_health(health.status_code, body, agent)]
    if agent:
        out += _agent_health(body)
    try:
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        metrics = None
        out.append(error("server.metrics", f"{url}/metrics did not answer ({e})", "check the server's log"))
    if metrics is not None and metrics.status_code in (401, 403):
        out.append(warn("server.metrics", f"{url}/metrics needs the API key ({metrics.status_code})",
                        "set $OPENGLM_API_KEY or pass --api-key-file PATH"))
    elif metrics is not None and metrics.status_code == 200:
        samples = parse_metrics(metrics.text)
        out += _agent_metrics(samples) if agent else _serve_metrics(samples)
    out += _leak(url, watch_s)
    return out


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _value(samples, name: str, default: float | None = None) -> float | None:
    found = samples.get(name)
    return sum(v for _, v in found) if found else default


def _health(status: int, body: dict, agent: bool) -> Check:
    kind = "agent-server" if agent else "openglm serve"
    if status != 200:
        return error("server.health", f"{kind}: /health answered {status} {body}",
                     "the engine thread stopped or the store is down: see the server's log, then restart it")
    return ok("server.health", f"{kind}: /health ok", kind=kind)


def _agent_health(body: dict) -> list[Check]:
    out = []
    if body.get("store") != "ok":
        out.append(error("server.store", f"task store: {body.get('store')}", "the database (or Redis) is unreachable "
                         "or was replaced: check --data-dir / --redis, then restart the agent-server"))
    else:
        out.append(ok("server.store", "task store: ok"))
    if "workers_alive" in body:
        alive = body["workers_alive"]
        out.append(ok("server.workers", f"workers alive: {alive}") if alive else
                   error("server.workers", "no worker is alive: tasks will not run",
                         "restart the agent-server (or `openglm worker`), and read why they stopped in its log"))
    return out


def _serve_metrics(samples) -> list[Check]:
    used, total = _value(samples, "openglm_kv_blocks_used"), _value(samples, "openglm_kv_blocks_total")
    running, waiting = _value(samples, "openglm_requests_running", 0), _value(samples, "openglm_requests_waiting", 0)
    out = []
    if not total:
        return [warn("server.metrics", "no KV metrics in /metrics: is this an openglm server?", "point --url at "
                     "`openglm serve` or `openglm agent-server`")]
    share = used / total
    kv = f"KV cache {used:.0f} of {total:.0f} blocks in use ({share:.0%})"
    out.append(warn("server.kv", kv, OOM_FIX, used=used, total=total) if share >= KV_FULL else
               ok("server.kv", kv, used=used, total=total))
    queue = f"queue: {running:.0f} running, {waiting:.0f} waiting"
    if waiting and share >= KV_FULL:
        out.append(warn("server.queue", queue + ": requests wait for KV blocks", OOM_FIX))
    elif waiting:
        out.append(info("server.queue", queue + ": the batch is full", "more --max-num-seqs, if the KV pool has room"))
    else:
        out.append(ok("server.queue", queue))
    preempted = _value(samples, "openglm_preemptions", 0)
    if preempted:
        out.append(warn("server.preemptions", f"{preempted:.0f} sequence(s) preempted and recomputed: the KV pool ran "
                        "out mid-generation", OOM_FIX, preemptions=preempted))
    failed = sum(v for labels, v in samples.get("openglm_request_errors_total", [])
                 if labels.get("status", "")[:1] == "5")
    if failed:
        out.append(warn("server.errors", f"{failed:.0f} request(s) answered with a 5xx error",
                        "the server's log names each one (run it with --log-level info)"))
    hits = _value(samples, "openglm_prefix_cache_hit_blocks", 0)
    queries = _value(samples, "openglm_prefix_cache_query_blocks", 0)
    if queries:
        out.append(ok("server.prefix_cache", f"prefix (session) cache: {hits / queries:.0%} of prompt blocks reused"))
    return out


def _agent_metrics(samples) -> list[Check]:
    growth = [(labels.get("task", "?"), v) for labels, v in
              samples.get("openglm_task_rss_growth_long_bytes_per_second", [])]
    leaking = [(task, v) for task, v in growth if v > LEAK_BYTES_PER_S]
    if leaking:
        where = ", ".join(f"task {t}: +{v * 60 / 2**20:.1f} MiB/min" for t, v in leaking[:6])
        return [warn("server.leak", f"memory grows steadily in {len(leaking)} task(s): {where}",
                     "the write-up's remedy: cap the task's memory (constraints.resource) and let the resilience "
                     "layer restart it; find the allocation with tracemalloc (snapshot.statistics('lineno'))",
                     tasks=leaking)]
    return [ok("server.leak", f"task memory: no steady growth in {len(growth)} task(s) watched")]


def _leak(url: str, watch_s: float) -> list[Check]:
    """RSS of the local process listening on the URL's port, sampled for `watch_s` seconds."""
    parsed = urlparse(url)
    if not parsed.hostname or not is_loopback(parsed.hostname) or watch_s <= 0:
        return []
    pid = _listener(parsed.port or (443 if parsed.scheme == "https" else 80))
    if pid is None:
        return [info("server.process", "cannot see the server's process here (another user's, or a container): no "
                     "memory-growth estimate")]
    proc = psutil.Process(pid)
    times, rss = [], []
    end = time.monotonic() + watch_s
    while True:
        times.append(time.monotonic())
        rss.append(proc.memory_info().rss)
        if times[-1] >= end:
            break
        time.sleep(min(0.25, max(0.0, end - times[-1])))
    slope, tau = theil_sen(np.asarray(times), np.asarray(rss, dtype=np.float64))
    text = (f"server process {pid}: RSS {rss[-1] / 2**20:,.0f} MiB, {slope * 60 / 2**20:+.2f} MiB/min over "
            f"{watch_s:g} s ({len(rss)} samples)")
    data = {"pid": pid, "rss": rss[-1], "bytes_per_s": slope, "tau": tau}
    if slope > LEAK_BYTES_PER_S and tau > LEAK_TAU:
        return [warn("server.leak", text + ": growing steadily", "watch it longer (--watch 60) under a steady load; "
                     "a real leak: restart the server periodically and cap its memory (the write-up's remedy), find "
                     "the allocation with tracemalloc", **data)]
    return [ok("server.leak", text, **data)]


def _listener(port: int) -> int | None:
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    return next((c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                 and c.pid), None)


def _json(response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
