"""Agent fault soak: a 200-step task on 3 worker processes while the store and the workers fail.

    flock /tmp/openglm-bench.lock .venv/bin/python benchmarks/bench_fault_soak.py [--steps 200]

Two runs, loopback and temp folders only:
  sqlite: the store on a small tmpfs (root; otherwise SQLite's max_page_count stands in for it):
          the disk fills up (real ENOSPC), a worker is SIGKILLed mid-step, then every worker is
          SIGKILLed, the file is corrupted, a worker refuses it in one line, and it is restored from
          `openglm task backup` with `openglm task restore`;
  redis:  redis-server (AOF, fsync always) is restarted mid-task and a worker is SIGKILLed mid-step.
Each step's command appends its step number to a file and leaves a background sleeper marked in
its argv[0]; the table reports whether the task finished, steps lost / repeated (committed steps
and the file's lines), and orphan processes (the process table scanned for the marker, 1 s after
each SIGKILL and at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from machine import cpu_model  # benchmarks/machine.py (scripts run with benchmarks/ on sys.path)

PY = sys.executable
LEASE = "3"


def marked(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(marker.encode()):
                out.append(int(pid))
        except OSError:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, root: Path, store_url: str, steps: int, open_store):
        self.root, self.store_url, self.steps, self.open_store = root, store_url, steps, open_store
        self._store = None
        self.marker = f"soak-{uuid.uuid4().hex[:8]}"
        self.ws = root / "ws"
        self.ws.mkdir()
        self.data = root / "data"
        script = root / "turns.jsonl"
        with open(script, "w") as f:
            for i in range(1, steps + 1):
                cmd = f"echo {i} >> steps.txt; (bash -c 'exec -a {self.marker} sleep 30' &); sleep 0.05"
                f.write(json.dumps({"content": "", "tool_calls": [{"name": "bash", "arguments": {"command": cmd}}]})
                        + "\n")
            f.write(json.dumps({"content": "", "tool_calls": [{"name": "submit", "arguments": {"summary": "ok"}}]})
                    + "\n")
        self.script = script
        self.workers: list[subprocess.Popen] = []
        self.events: list[str] = []
        self.orphans_after_kill: list[int] = []

    def worker_cmd(self) -> list[str]:
        return [PY, "-m", "openglm.agent", "worker", "--store", self.store_url, "--data-dir", str(self.data),
                "--replay", str(self.script), "--lease-ttl", LEASE]

    def start_workers(self, n: int) -> None:
        for _ in range(n):
            self.workers.append(subprocess.Popen(self.worker_cmd(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                 text=True))

    def kill_workers(self, which) -> None:
        for w in which:
            w.send_signal(signal.SIGKILL)
            w.wait()
            self.workers.remove(w)
        time.sleep(1.0)
        self.orphans_after_kill.append(len(marked(self.marker)))

    def kill_owner_at(self, step: int) -> None:
        """SIGKILL the worker that runs the task once it reaches `step`, and start a replacement."""
        self.wait_step(step)
        victim = self.owner()
        if victim is not None:
            self.kill_workers([victim])
            self.start_workers(1)
            self.events.append(f"SIGKILL of the owning worker at step {self.task().step}")

    def owner(self):
        task = self.task()
        return next((w for w in self.workers if f"-{w.pid}-" in task.worker), None)

    def store(self):
        if self._store is None:
            self._store = self.open_store()
        return self._store

    def close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def task(self):
        while True:
            try:
                return self.store().get_task(self.task_id)
            except Exception:  # noqa: BLE001 - the store is being faulted: look again shortly
                self.close_store()
                time.sleep(0.2)

    def wait_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.task().step < step and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait_state(self, states, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.task()
            if t.state in states:
                return t
            time.sleep(0.1)
        return self.task()

    def submit(self) -> None:
        from openglm.agent import service
        from openglm.agent.config import AgentConfig

        config = AgentConfig(data_dir=str(self.data), store=self.store_url)
        self.task_id = service.submit(self.store(), config, "soak", str(self.ws), {"max_steps": self.steps + 5}).id

    def report(self, name: str, seconds: float) -> dict:
        from openglm.agent.store import open_store

        store = open_store(self.store_url)
        task = store.get_task(self.task_id)
        committed = [e.step for e in store.all_events(self.task_id) if e.kind == "step_committed"]
        lines = ([int(x) for x in (self.ws / "steps.txt").read_text().split()]
                 if (self.ws / "steps.txt").exists() else [])
        expected = list(range(1, self.steps + 1))
        return {"run": name, "state": task.state, "seconds": seconds,
                "lost": len(set(range(0, self.steps + 2)) - set(committed)) + len(set(expected) - set(lines)),
                "repeated": (len(committed) - len(set(committed))) + (len(lines) - len(set(lines))),
                "file_ok": lines == expected, "orphans_after_kill": self.orphans_after_kill,
                "orphans_end": len(marked(self.marker)), "events": self.events}


def fill(path: Path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def sqlite_run(root: Path, steps: int) -> dict:
    from openglm.agent.store.sqlite_store import SQLiteStore

    mnt = root / "store-fs"
    mnt.mkdir()
    tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                           capture_output=True).returncode == 0
    db = mnt / "agent.db"
    soak = Soak(root, str(db), steps, lambda: SQLiteStore(str(db)))
    soak.events.append("store on a 24 MB tmpfs" if tmpfs else "store on disk (not root: no tmpfs)")
    try:
        soak.submit()
        t0 = time.monotonic()
        soak.start_workers(3)
        soak.wait_step(steps // 5)
        filler = mnt / "filler"  # 1. the disk fills up while the task runs
        fill(filler)
        stuck_at, since, deadline = soak.task().step, time.monotonic(), time.monotonic() + 60
        while time.monotonic() < deadline and time.monotonic() - since < 4:  # full until the task is blocked
            step = soak.task().step
            if step != stuck_at:
                stuck_at, since = step, time.monotonic()
            time.sleep(0.1)
        filler.unlink()
        paused = soak.wait_state({"PAUSED"}, timeout=60)
        soak.events.append(f"disk full at step {steps // 5}, blocked at step {stuck_at}: task {paused.state} "
                           f"({paused.reason[:60]})")
        if paused.state == "PAUSED":
            from openglm.agent import service

            service.resume(soak.store(), soak.task_id)
        soak.kill_owner_at(steps * 9 // 20)  # 2. the owning worker is SIGKILLed mid-step
        soak.wait_step(steps * 7 // 10)  # 3. every worker dies; the file is corrupted; restore the backup
        soak.kill_workers(list(soak.workers))
        backup = root / "backup.db"
        cli = [PY, "-m", "openglm.agent", "task"]
        subprocess.run(cli + ["backup", str(backup), "--store", str(db)], check=True, capture_output=True)
        soak.close_store()
        SQLiteStore(str(db)).close()  # the last connection checkpoints the WAL into the file
        with open(db, "r+b") as f:
            f.truncate(4096)
        refused = subprocess.run(soak.worker_cmd() + ["--once"], capture_output=True, text=True, timeout=60)
        soak.events.append(f"corrupt store: worker exit {refused.returncode}, "
                           f"{len(refused.stderr.strip().splitlines())} line: {refused.stderr.strip()[:70]}...")
        subprocess.run(cli + ["restore", str(backup), "--store", str(db)], check=True, capture_output=True)
        soak.start_workers(3)
        final = soak.wait_state({"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"}, timeout=900)
        soak.events.append(f"restored from backup; task {final.state}")
        soak.close_store()
        result = soak.report("sqlite", time.monotonic() - t0)
    finally:
        soak.kill_workers(list(soak.workers))
        soak.close_store()
        if tmpfs:
            subprocess.run(["umount", "-l", str(mnt)])
    return result


def redis_run(root: Path, steps: int) -> dict:
    from openglm.agent.store.redis_store import RedisStore

    if not shutil.which("redis-server"):
        return {"run": "redis", "state": "skipped: no redis-server", "events": []}
    port = free_port()
    rdir = root / "redis"
    rdir.mkdir()

    def start_redis():
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(rdir),
                                 "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
                                stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        return proc

    redis_proc = start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    soak = Soak(root, url, steps, lambda: RedisStore(url))
    try:
        soak.submit()
        t0 = time.monotonic()
        soak.start_workers(3)
        soak.wait_step(steps * 3 // 10)  # 1. Redis restarts under the running task
        redis_proc.terminate()
        redis_proc.wait()
        time.sleep(3.0)
        redis_proc = start_redis()
        soak.events.append(f"redis restarted at step {soak.task().step} (down 3 s); task {soak.task().state}")
        soak.kill_owner_at(steps * 6 // 10)  # 2. the owning worker is SIGKILLed mid-step
        final = soak.wait_state({"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT", "PAUSED"}, timeout=900)
        soak.events.append(f"task {final.state} {final.reason[:50]}")
        result = soak.report("redis", time.monotonic() - t0)
    finally:
        soak.kill_workers(list(soak.workers))
        redis_proc.terminate()
        redis_proc.wait()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of the soak task (default: 200)")
    ap.add_argument("--only", choices=["sqlite", "redis"], help="run one store only (default: both)")
    args = ap.parse_args()
    results = []
    for name, run in (("sqlite", sqlite_run), ("redis", redis_run)):
        if args.only in (None, name):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(run(Path(tmp), args.steps))
    print(f"\nbench_fault_soak  CPU: {cpu_model()} ({os.cpu_count()} cores)  steps: {args.steps}  workers: 3  "
          f"lease: {LEASE} s\n")
    print("| store | task | seconds | steps lost | steps repeated | step file exact | "
          "orphans 1 s after each SIGKILL | orphans at end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['state']} | {r.get('seconds', 0):.0f} | {r.get('lost', '-')} | "
              f"{r.get('repeated', '-')} | {r.get('file_ok', '-')} | {r.get('orphans_after_kill', '-')} | "
              f"{r.get('orphans_end', '-')} |")
    for r in results:
        print(f"\n{r['run']}:", *r["events"], sep="\n  - ")
    ok = all(r["state"] == "SUCCEEDED" and r["lost"] == 0 and r["repeated"] == 0 and r["orphans_end"] == 0
             and not any(r["orphans_after_kill"]) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
