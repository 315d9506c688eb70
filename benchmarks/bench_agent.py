"""Agent runtime benchmark: per-step overhead, snapshot cost, rollback time, resume after SIGKILL.

For repositories of 100 / 1,000 / 10,000 files, each step changes 10 files:
- step overhead: wall time of a step minus model time and tool time (store writes, snapshot,
  bookkeeping), with the replay model (goal < 20 ms);
- snapshot: time and bytes stored per step; "rescan ms": the same snapshot when nothing tells it
  which paths changed (no inotify, or the first one after a (re)start or a watcher overflow);
- rollback: time to restore the previous snapshot (10 files differ; goal <= 50 ms at 1,000 files);
- resume: a worker SIGKILLed mid-task; time from a new worker run starting until it is ready for
  the next step (claim + log replay + workspace restore), in-process (fork) and as a fresh
  `python -m openglm.agent worker` process (interpreter start included);
- command start-up: what the sandbox adds to every command a task runs: `true` started bare, under the
  reaper launcher (`--unsafe-no-sandbox`) and in the bubblewrap sandbox, as a process (`proc.run`) and
  as the bash tool's whole call (`run_shell`: output reader, polling, pid record, clean-up).

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_agent.py [--sizes 100,1000,10000] [--json]
    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_agent.py --only startup
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model, isa  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)
from tqdm import tqdm

from openglm.agent import faults, service
from openglm.agent.config import AgentConfig
from openglm.agent.hooks import Hooks
from openglm.agent.llm import ReplayModel
from openglm.agent.snapshot import Snapshots
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.tools.shell import run_shell
from openglm.agent.worker import Worker
from openglm.util import proc
from openglm.util.sandbox import Sandbox, SandboxConfig, probe

STEPS = 12


def make_repo(root: Path, n_files: int):
    per_dir = 100
    for i in range(n_files):
        d = root / f"pkg{i // per_dir:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i % per_dir:03d}.py").write_text(f"# module {i}\n" + "x = 1\n" * 20)


def change_turn(step: int, n_files: int) -> dict:
    calls = []
    for j in range(10):
        i = (step * 10 + j * 7) % n_files
        calls.append({"name": "create", "arguments": {"path": f"pkg{i // 100:03d}/mod{i % 100:03d}.py",
                                                      "content": f"# step {step} file {j}\n", "overwrite": True}})
    return {"content": "", "tool_calls": calls}


def timing_hooks(acc: dict, marks: list) -> Hooks:
    class Timed:  # a model and tool wrapper: the time spent inside the run's model calls / tool calls
        def __init__(self, key, inner):
            self.key, self.inner, self.name = key, inner, getattr(inner, "name", key)

        def _timed(self, method, *a):
            t = time.perf_counter()
            try:
                return method(*a)
            finally:
                acc[self.key] += time.perf_counter() - t

        def query(self, *a):
            return self._timed(self.inner.query, *a)

        def call(self, *a):
            return self._timed(self.inner.call, *a)

    def wrap(key):
        return lambda inner, ctx: Timed(key, inner)

    def mark(ctx, record):  # wall clock and model/tool totals at each step commit
        marks.append((time.perf_counter(), acc["model"], acc["tools"]))

    return Hooks(model_wrappers=[wrap("model")], tool_wrappers=[wrap("tools")], step_callbacks=[mark])


def bench_steps(tmp: Path, n_files: int) -> dict:
    ws = tmp / f"ws{n_files}"
    make_repo(ws, n_files)
    config = AgentConfig(data_dir=str(tmp / f"data{n_files}"))
    store = SQLiteStore(config.store_url)
    turns = [change_turn(s, n_files) for s in range(STEPS)] + [{"tool_calls": [{"name": "submit", "arguments": {}}]}]
    service.submit(store, config, "bench", str(ws))
    acc = {"model": 0.0, "tools": 0.0}
    marks: list = []
    snap_times = []
    original_take = Snapshots.take

    def timed_take(self, message="snapshot"):
        t = time.perf_counter()
        try:
            return original_take(self, message)
        finally:
            snap_times.append(time.perf_counter() - t)

    Snapshots.take = timed_take
    try:
        state = Worker(config, store=store, model=ReplayModel(turns), hooks=timing_hooks(acc, marks)).run_one()
    finally:
        Snapshots.take = original_take
    assert state == "SUCCEEDED", state
    # per step (commit to commit, the first-run setup and initial full snapshot excluded):
    # wall time minus the model's and the tools' time
    overheads = [(t1 - t0) - (m1 - m0) - (x1 - x0) for (t0, m0, x0), (t1, m1, x1) in zip(marks, marks[1:])]
    steps = len(turns)
    overhead = statistics.median(overheads)

    # snapshot bytes and rollback on a fresh snapshot store of the same repo
    snaps = Snapshots(ws, tmp / f"snap{n_files}.git")
    snaps.take("base")
    sizes, restores, ids = [], [], [snaps.head]
    for s in range(10):
        for call in change_turn(100 + s, n_files)["tool_calls"]:
            (ws / call["arguments"]["path"]).write_text(call["arguments"]["content"])
        before = snaps.stored_bytes()
        ids.append(snaps.take(f"s{s}"))
        sizes.append(snaps.stored_bytes() - before)
    for s in range(10):
        t = time.perf_counter()
        snaps.restore(ids[-2] if s % 2 == 0 else ids[-1])
        restores.append(time.perf_counter() - t)
    snaps.close()
    rescan, rescans = Snapshots(ws, tmp / f"snap{n_files}.git", track=False), []
    for s in range(5):
        for call in change_turn(200 + s, n_files)["tool_calls"]:
            (ws / call["arguments"]["path"]).write_text(call["arguments"]["content"])
        t = time.perf_counter()
        rescan.take(f"r{s}")
        rescans.append(time.perf_counter() - t)
    return {"files": n_files, "steps": steps, "step_overhead_ms": overhead * 1e3,
            "snapshot_ms": statistics.median(snap_times[1:]) * 1e3,
            "snapshot_bytes": statistics.median(sizes), "rollback_ms": statistics.median(restores) * 1e3,
            "rescan_ms": statistics.median(rescans) * 1e3,
            "model_ms_per_step": acc["model"] / steps * 1e3, "tool_ms_per_step": acc["tools"] / steps * 1e3}


def bench_resume(tmp: Path, n_files: int = 1000, kill_after_steps: int = 20) -> dict:
    ws = tmp / "resume-ws"
    make_repo(ws, n_files)
    config = AgentConfig(data_dir=str(tmp / "resume-data"), lease_ttl=30)
    store = SQLiteStore(config.store_url)
    turns = [change_turn(s, n_files) for s in range(kill_after_steps + 5)]
    turns.append({"tool_calls": [{"name": "submit", "arguments": {}}]})
    task = service.submit(store, config, "resume", str(ws))
    calls_log = str(tmp / "resume-calls")
    # run until `kill_after_steps` are committed, then SIGKILL in the middle of the next step's tool calls
    pid = os.fork()
    if pid == 0:
        try:
            class Stop(ReplayModel):
                def query(self, messages, tools=None):
                    if sum(m["role"] == "assistant" for m in messages) == kill_after_steps:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return super().query(messages, tools)
            Worker(config, store=SQLiteStore(config.store_url), model=Stop(turns)).run_one()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    results = {"log_events": store.event_count(task.id), "committed_steps": store.get_task(task.id).step}
    # a crash mid-step: half the files of the next step written
    for call in change_turn(999, n_files)["tool_calls"][:5]:
        (ws / call["arguments"]["path"]).write_text("half-written by a killed step\n")

    def first_call_after(t0: float) -> float:
        lines = open(calls_log).read().split("\n") if os.path.exists(calls_log) else []
        return min(float(x.split()[1]) for x in lines if x and float(x.split()[1]) > t0)

    fork_lat, proc_lat = [], []
    for _ in range(5):
        # in-process runtime: fork (no interpreter start), claim, rebuild, restore, first model call
        store.update_task(task.id, {"lease_until": 0.0, "state": "RUNNING"})
        t0 = time.time()
        pid = os.fork()
        if pid == 0:
            try:
                faults._target, faults._hits = 0, 0
                Worker(config, store=SQLiteStore(config.store_url),
                       model=KillOnCall(turns, calls_log=calls_log)).run_one()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        fork_lat.append(first_call_after(t0) - t0)
        # a fresh worker process (interpreter start + imports included)
        store.update_task(task.id, {"lease_until": 0.0, "state": "RUNNING"})
        script = tmp / "resume.jsonl"
        script.write_text("\n".join(json.dumps(t) for t in turns))
        store.update_task(task.id, {"meta": {"model": {"replay": str(script), "calls_log": calls_log}}})
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-m", "openglm.agent", "worker", "--data-dir", config.data_dir,
                              "--once"], stdout=subprocess.DEVNULL)
        while True:
            try:
                proc_lat.append(first_call_after(t0) - t0)
                break
            except ValueError:
                time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
        p.wait()
        store.update_task(task.id, {"meta": {}})
    results.update(resume_ms_fork=statistics.median(fork_lat) * 1e3,
                   resume_ms_process=statistics.median(proc_lat) * 1e3)
    return results


def bench_startup(tmp: Path, repeats: int = 40) -> list[dict]:
    """Milliseconds to run `true` (median, p90) per launcher, as a process and as the bash tool's call."""
    ws = tmp / "startup-ws"
    ws.mkdir()
    rows = []
    for name, config in (("bare", None), ("reaper (--unsafe-no-sandbox)", SandboxConfig(enabled=False)),
                         ("bwrap sandbox", SandboxConfig())):
        box = Sandbox(config, str(ws)) if config is not None else None
        try:
            def process():
                assert proc.run(["true"], cwd=ws, sandbox=box, env=box.env() if box else None).ok

            def tool():
                assert run_shell("true", str(ws), sandbox=box or Sandbox(SandboxConfig(enabled=False), str(ws))
                                 ).exit_code == 0
            row = {"launcher": name}
            for part, fn in (("process", process), ("tool", tool if box is not None else None)):
                if fn is None:
                    continue
                fn()  # warm-up: the first sandbox scans /etc once per process
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t) * 1e3)
                times.sort()
                row[f"{part}_median_ms"] = statistics.median(times)
                row[f"{part}_p90_ms"] = times[int(0.9 * (len(times) - 1))]
            rows.append(row)
        finally:
            if box is not None:
                box.close()
    return rows


def print_startup(rows: list[dict], repeats: int) -> None:
    print(f"\ncommand start-up (`true`, {repeats} runs each; milliseconds):")
    print(f"{'launcher':>28} | {'process median':>14} | {'process p90':>11} | {'tool median':>11} | {'tool p90':>8}")
    print("-" * 86)
    for r in rows:
        tool = (f"{r['tool_median_ms']:>11.1f} | {r['tool_p90_ms']:>8.1f}" if "tool_median_ms" in r
                else f"{'-':>11} | {'-':>8}")
        print(f"{r['launcher']:>28} | {r['process_median_ms']:>14.1f} | {r['process_p90_ms']:>11.1f} | {tool}")
    print("(process: proc.run; tool: the bash tool's run_shell, output reader and clean-up included)")


class KillOnCall(ReplayModel):
    """Records the call (its time is the resume latency mark), then dies like a killed worker."""

    def query(self, messages, tools=None):
        super().query(messages, tools)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--only", choices=["steps", "startup"], help="run one part (default: all)")
    ap.add_argument("--repeats", type=int, default=40, help="runs per launcher for the start-up figures")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.only != "steps" and probe() is not None:
        raise SystemExit(f"bench_agent: no sandbox here ({probe()})")
    rows, resume, startup = [], None, []
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as d:
        tmp = Path(d)
        if args.only != "startup":
            rows = [bench_steps(tmp, n) for n in tqdm(sizes, desc="repo sizes", disable=args.json)]
            resume = bench_resume(tmp)
        if args.only != "steps":
            startup = bench_startup(tmp, args.repeats)
    if args.json:
        print(json.dumps({"steps": rows, "resume": resume, "startup": startup}, indent=2))
        return
    print(f"\nbench_agent  CPU: {cpu_model()} ({os.cpu_count()} cores; {isa()})")
    if rows:
        print(f"\n{'files':>7} | {'step overhead ms':>16} | {'snapshot ms':>11} | {'snapshot bytes':>14} | "
              f"{'rollback ms':>11} | {'rescan ms':>9}")
        print("-" * 85)
        for r in rows:
            print(f"{r['files']:>7} | {r['step_overhead_ms']:>16.1f} | {r['snapshot_ms']:>11.1f} | "
                  f"{r['snapshot_bytes']:>14.0f} | {r['rollback_ms']:>11.1f} | {r['rescan_ms']:>9.1f}")
        print(f"\nresume after SIGKILL ({resume['committed_steps']} committed steps, {resume['log_events']} events, "
              f"1,000 files, 5 files half-written): {resume['resume_ms_fork']:.1f} ms in-process (fork), "
              f"{resume['resume_ms_process']:.1f} ms as a new worker process")
        print("(10-file change per step; medians; step overhead = median commit-to-commit time - model time - "
              "tool time)")
    if startup:
        print_startup(startup, args.repeats)


if __name__ == "__main__":
    main()
