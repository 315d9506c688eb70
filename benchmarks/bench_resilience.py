"""Resilience benchmark: leak detection, monitor overhead, and a fault-injected soak.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_resilience.py [--json] [--only leak,overhead,soak]

Leak detection runs real child processes at a 60x compressed time scale (1 s stands for 1 min):
the write-ups' 10 MB/min becomes 10 MB/s, the 5-minute window 5 s, the 1-hour window 60 s, the
5 s sampling interval 1/12 s; latencies are reported back in real-time minutes. The detector is the
monitor's (Theil-Sen slope + Kendall trend); an ordinary least-squares slope on the same samples
is shown for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from tqdm import tqdm

MB = 1024 * 1024
SCALE = 60.0  # seconds of real time per benchmark second

CHILD = r"""
import random, sys, time
leak_mb_s, noise_mb, seed, spike_mb = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
random.seed(seed); held = []; t0 = time.monotonic(); leaked = 0.0; spike, spike_end = None, 0.0
while True:
    now = time.monotonic()
    if spike is None and spike_mb and random.random() < 0.03:  # a big temporary allocation, held a while
        spike, spike_end = b"\x01" * int(spike_mb * 1024 * 1024), now + random.uniform(0.3, 1.5)
    if spike is not None and now > spike_end:
        spike = None
    target = leak_mb_s * (time.monotonic() - t0)
    if target - leaked >= 0.5 and leaked < 1500:
        held.append(b"\x01" * int((target - leaked) * 1024 * 1024)); leaked = target
    blob = b"\x01" * int(random.uniform(0, noise_mb) * 1024 * 1024) if noise_mb else b""
    time.sleep(random.uniform(0.02, 0.12))
    del blob
"""


def _monitor_config():
    from openglm.agent.resilience import Action, MonitorConfig, Threshold

    defaults = MonitorConfig().thresholds
    th = {"rss_growth_short": Threshold(10 * MB / 60 * SCALE, Action.RESTART_TREE,
                                        sustain=defaults["rss_growth_short"].sustain),
          "rss_growth_long": Threshold(2 * MB / 3600 * SCALE, Action.RESTART_TREE,
                                       sustain=defaults["rss_growth_long"].sustain),
          "cpu_percent": None, "disk_free_bytes": None}
    return MonitorConfig(interval_s=5.0 / SCALE, short_window_s=300 / SCALE, long_window_s=3600 / SCALE,
                         thresholds=th)


def leak_trial(leak_mb_min: float, noise_mb: float, spike_mb: float, duration_s: float, seed: int) -> dict:
    """One child; sample until the detector fires or `duration_s` passes. Returns what happened."""
    from openglm.agent.resilience import ResourceMonitor

    cfg = _monitor_config()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(leak_mb_min / 60 * SCALE), str(noise_mb), str(seed),
                             str(spike_mb)])
    fired, samples = [], []
    mon = ResourceMonitor(cfg, roots=[proc.pid], workspace=".", handlers={})
    mon.handlers = {a: (lambda alert: fired.append(alert)) for a in {t.action for t in cfg.thresholds.values() if t}}
    start = time.monotonic()
    try:
        while time.monotonic() - start < duration_s and not fired:
            r = mon.sample()
            samples.append((r["t"], r["rss_bytes"]))
            time.sleep(cfg.interval_s)
    finally:
        proc.kill()
        proc.wait()
    latency = time.monotonic() - start if fired else None
    return {"fired": bool(fired), "rule": fired[0].metric if fired else None,
            "latency_real_min": latency * SCALE / 60 if latency else None,
            "ols_false_alarm": _ols_fires(samples, cfg)}


def _ols_fires(samples, cfg) -> bool:
    """Would a least-squares slope over the short window have fired at any point of this trace?"""
    limit, span = cfg.thresholds["rss_growth_short"].limit, cfg.short_window_s
    arr = np.asarray(samples, dtype=float)
    for i in range(len(arr)):
        win = arr[(arr[:, 0] > arr[i, 0] - span) & (arr[:, 0] <= arr[i, 0])]
        if len(win) >= 3 and win[-1, 0] - win[0, 0] >= 0.5 * span:
            if np.polyfit(win[:, 0] - win[0, 0], win[:, 1], 1)[0] > limit:
                return True
    return False


def bench_leak(trials: int, steady_s: float) -> list[dict]:
    rows = []
    # (case, leak MB/min, noise MB, spike MB, seconds observed); leaks carry the same noise
    cases = [("steady, noisy", 0.0, 40.0, 0.0, steady_s), ("steady, noisy + spikes", 0.0, 40.0, 150.0, steady_s),
             ("leak 2 MB/min", 2.0, 40.0, 0.0, 40.0), ("leak 10 MB/min", 10.0, 40.0, 0.0, 40.0),
             ("leak 50 MB/min", 50.0, 40.0, 0.0, 20.0)]
    for name, rate, noise, spike, duration in tqdm(cases, desc="leak cases", disable=None):
        results = [leak_trial(rate, noise, spike, duration, seed) for seed in range(trials)]
        lat = [r["latency_real_min"] for r in results if r["fired"]]
        rows.append({"case": name, "trials": trials, "detected": sum(r["fired"] for r in results),
                     "rules": sorted({r["rule"] for r in results if r["rule"]}),
                     "median_latency_real_min": round(statistics.median(lat), 2) if lat else None,
                     "ols_fired": sum(r["ols_false_alarm"] for r in results),
                     "observed_real_min": round(duration * SCALE / 60, 1)})
    return rows


def bench_overhead(children: int, seconds: float) -> list[dict]:
    """CPU time the sampler spends per reading, over a tree of `children` processes."""
    from openglm.agent.resilience import MonitorConfig, ResourceMonitor

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(children)]
    try:
        mon = ResourceMonitor(MonitorConfig(), roots=[os.getpid()], workspace=".")
        mon.sample()
        n, cpu0, t0 = 0, time.process_time(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            mon.sample()
            n += 1
        per_sample = (time.process_time() - cpu0) / n
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [{"tree_processes": children + 1, "samples": n, "cpu_ms_per_sample": round(per_sample * 1e3, 3),
             "cpu_percent_at_1s": round(per_sample / 1.0 * 100, 3),
             "cpu_percent_at_5s": round(per_sample / 5.0 * 100, 3)}]


# ---- soak: a long scripted task with injected faults, run by worker processes that get killed ----

SOAK_WORKER = r"""
import sys
from openglm.agent.config import AgentConfig
from openglm.agent.llm import FallbackModel
from openglm.agent.llm.openai_chat import OpenAIChatModel
from openglm.agent.resilience import LadderConfig, LadderPolicy, ResilienceConfig, MonitorConfig
from openglm.agent.resilience.config import _default_policies
from openglm.agent.resilience.hooks import ResilienceHooks
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker
data_dir, db, url = sys.argv[1:4]
policies = {k: LadderPolicy(**{**p.__dict__, "backoff_s": 0.05}) for k, p in _default_policies().items()}
rcfg = ResilienceConfig(monitor=MonitorConfig(interval_s=0.5), ladder=LadderConfig(policies=policies))
model = FallbackModel(OpenAIChatModel(url + "/primary", "primary", timeout=0.5),
                      OpenAIChatModel(url + "/fallback", "fallback", timeout=2.0))
worker = Worker(AgentConfig(data_dir=data_dir, lease_ttl=1.5, poll_interval=0.05), store=SQLiteStore(db),
                model=model, hooks=ResilienceHooks(rcfg))
worker.run_one() or worker.serve(max_tasks=1)
"""


class _SoakModelServer:
    """An OpenAI-compatible endpoint scripted from the conversation (stateless, like the replay model):
    turn i appends `i+1` to progress.txt; every 100th command hangs once; `rate` of /primary requests
    fail (500 / 429 / a hang past the client timeout) at random."""

    def __init__(self, steps: int, rate: float, seed: int = 0):
        import http.server
        import random
        import threading

        self.steps, self.rate, self.rng = steps, rate, random.Random(seed)
        self.counts = {"requests": 0, "500": 0, "429": 0, "hang": 0}
        self.lock = threading.Lock()
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fault = me._fault() if self.path.startswith("/primary") else "ok"
                if fault == "hang":
                    time.sleep(1.0)
                if fault in ("500", "429"):
                    return self._send(int(fault), {"error": "injected"})
                i = sum(1 for m in body["messages"] if m["role"] == "assistant")
                self._send(200, {"choices": [{"message": me._turn(i)}], "usage": {"prompt_tokens": 50,
                                                                                   "completion_tokens": 10}})

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            do_GET = lambda self: self._send(200, {"data": []})  # noqa: E731 (reachability probe)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _fault(self) -> str:
        with self.lock:
            self.counts["requests"] += 1
            r = self.rng.random()
            fault = "ok" if r >= self.rate else ("500", "429", "hang")[int(3 * r / self.rate)]
            if fault != "ok":
                self.counts[fault] += 1
            return fault

    def _turn(self, i: int) -> dict:
        if i >= self.steps:
            call = {"name": "submit", "arguments": "{}"}
        else:
            cmd = f"echo {i + 1} >> progress.txt"
            if (i + 1) % 100 == 50:  # a command that hangs the first time it runs
                cmd = f"if [ ! -e .hung{i + 1} ]; then touch .hung{i + 1}; sleep 30; fi; " + cmd
            call = {"name": "bash", "arguments": json.dumps({"command": cmd})}
        return {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function",
                                                                    "function": call}]}


def run_soak(steps: int, kill_every: int, rate: float) -> dict:
    import signal
    import tempfile
    from pathlib import Path

    from openglm.agent import service
    from openglm.agent.config import AgentConfig
    from openglm.agent.store.sqlite_store import SQLiteStore

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    ws, db, data_dir = tmp / "ws", str(tmp / "agent.db"), str(tmp / "data")
    ws.mkdir()
    server = _SoakModelServer(steps, rate)
    store = SQLiteStore(db)
    check = f"python -c \"assert open('progress.txt').read().split() == [str(i) for i in range(1, {steps + 1})]\""
    task = service.submit(store, AgentConfig(data_dir=data_dir), f"append 1..{steps} to progress.txt", str(ws),
                          {"command_timeout": "1s", "max_steps": steps + 50, "deliverables": [{"command": check}]})
    kills, pauses, next_kill, start = 0, 0, kill_every, time.monotonic()
    bar = tqdm(total=steps, desc="soak steps", disable=None)
    proc = None
    while True:
        t = store.get_task(task.id)
        bar.n = min(t.step, steps)
        bar.refresh()
        if t.terminal or time.monotonic() - start > 900:
            break
        if t.state == "PAUSED":  # the ladder paused it (model down past L2): an operator resumes it
            pauses += 1
            service.resume(store, task.id)
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen([sys.executable, "-c", SOAK_WORKER, data_dir, db, server.url])
        if t.step >= next_kill and proc.poll() is None:
            time.sleep(np.random.default_rng(kills).uniform(0, 0.3))  # somewhere inside a step
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills, next_kill = kills + 1, next_kill + kill_every
        time.sleep(0.05)
    bar.close()
    if proc is not None and proc.poll() is None:
        proc.wait(30)
    lines = (ws / "progress.txt").read_text().split() if (ws / "progress.txt").exists() else []
    done = [int(x) for x in lines]
    evs = store.all_events(task.id)
    levels = [e.data["level"] for e in evs if e.kind == "recovery_escalation"]
    server.httpd.shutdown()
    return {"steps": steps, "state": store.get_task(task.id).state,
            "completed": store.get_task(task.id).state == "SUCCEEDED",
            "steps_lost": len(set(range(1, steps + 1)) - set(done)), "steps_duplicated": len(done) - len(set(done)),
            "worker_kills": kills, "model_requests": server.counts["requests"],
            "injected_500/429/hang": f"{server.counts['500']}/{server.counts['429']}/{server.counts['hang']}",
            "L1_retries": levels.count(1), "L2_fallbacks": levels.count(2), "safe_pauses": pauses,
            "hung_cmd_retries": sum(1 for e in evs if e.kind == "recovery_escalation" and "hung" in e.data["cause"]),
            "wall_s": round(time.monotonic() - start, 1)}


def _table(title: str, rows: list[dict]) -> str:
    if not rows:
        return f"{title}: no rows"
    cols = list(rows[0])
    cells = [[str(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [title, " | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--only", default="leak,overhead,soak", help="comma-separated sections")
    ap.add_argument("--trials", type=int, default=3, help="leak trials per case")
    ap.add_argument("--quick", action="store_true", help="shorter runs (smoke test)")
    ap.add_argument("--steady-s", type=float, default=30.0,
                    help="seconds each steady process is watched (x60 in real time: 30 s = 30 min)")
    ap.add_argument("--soak-steps", type=int, default=500)
    ap.add_argument("--soak-kill-every", type=int, default=100, help="SIGKILL the worker every N steps")
    ap.add_argument("--fault-rate", type=float, default=0.05, help="share of model requests that fail")
    args = ap.parse_args(argv)
    sections = set(args.only.split(","))
    results = {}
    if "leak" in sections:
        results["leak"] = bench_leak(args.trials, 20.0 if args.quick else args.steady_s)
    if "overhead" in sections:
        results["overhead"] = bench_overhead(children=20, seconds=2.0 if args.quick else 5.0)
    if "soak" in sections:
        results["soak"] = [run_soak(args.soak_steps, args.soak_kill_every, args.fault_rate)]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, rows in results.items():
            print(_table(f"== {name}", rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
