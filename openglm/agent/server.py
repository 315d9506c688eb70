"""`openglm agent-server`: the task API plus embedded workers in one process; `openglm worker`."""

from __future__ import annotations

import os
import sys
import threading

from openglm.agent.api import check_bind, create_app
from openglm.agent.config import AgentConfig
from openglm.agent.store import open_store
from openglm.agent.worker import Worker


SUPERVISE_S = 1.0  # how often dead worker threads are looked for


class WorkerPool:
    """Embedded workers, each in a thread, and a supervisor that restarts any thread that died
    (a worker's loop survives store faults; this covers everything else)."""

    def __init__(self, config: AgentConfig, n: int, stop: threading.Event, make_worker=None):
        self.config, self.stop = config, stop
        self.make_worker = make_worker or (lambda: Worker(config, store=open_store(config.store_url)))
        self.workers: list = [None] * n
        self.threads: list[threading.Thread | None] = [None] * n
        self.restarts = 0
        for i in range(n):
            self._start(i)
        self.supervisor = threading.Thread(target=self._supervise, daemon=True, name="agent-worker-supervisor")
        self.supervisor.start()

    def _start(self, i: int) -> None:
        self.workers[i] = worker = self.make_worker()
        t = threading.Thread(target=worker.serve, args=(self.stop,), daemon=True, name=f"agent-worker-{i}")
        t.start()
        self.threads[i] = t

    def _supervise(self) -> None:
        while not self.stop.wait(SUPERVISE_S):
            for i, t in enumerate(self.threads):
                if t is not None and not t.is_alive() and not self.stop.is_set():
                    print(f"agent-server: worker thread {i} died; restarting it", file=sys.stderr, flush=True)
                    self.restarts += 1
                    try:
                        self._start(i)
                    except Exception as exc:  # noqa: BLE001 - e.g. the store cannot open yet: next round
                        print(f"agent-server: cannot restart worker {i}: {exc}", file=sys.stderr, flush=True)

    def health(self) -> dict:
        alive = sum(1 for t in self.threads if t is not None and t.is_alive())
        errors = sorted({w.store_error for w in self.workers if w is not None and w.store_error})
        return {"workers": len(self.threads), "workers_alive": alive, "worker_restarts": self.restarts,
                "worker_store_errors": errors}


def start_workers(config: AgentConfig, n: int, stop: threading.Event) -> WorkerPool:
    return WorkerPool(config, n, stop)


def serve(config: AgentConfig, host: str = "127.0.0.1", port: int = 8100, workers: int = 1,
          token: str | None = None, view_token: str | None = None) -> None:
    import uvicorn  # the server's heavy dependency: loaded when serving

    token = token or os.environ.get("OPENGLM_AGENT_TOKEN") or None
    view_token = view_token or os.environ.get("OPENGLM_AGENT_VIEW_TOKEN") or None
    check_bind(host, token)
    if view_token and not token:
        raise ValueError("a read-only --view-token needs a full --token too (else every caller has full control)")
    stop = threading.Event()
    pool = start_workers(config, workers, stop)
    app = create_app(config, token=token, view_token=view_token,
                     workers=pool if workers > 0 else None)  # 0 workers: API only, /health needs none
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        stop.set()


def run_worker(config: AgentConfig, max_tasks: int | None = None) -> int:
    # No graceful-stop dance: a killed worker's task is resumed by another once its lease expires.
    stop = threading.Event()
    worker = Worker(config)
    print(f"worker {worker.id} polling {config.store_url}", flush=True)
    return worker.serve(stop, max_tasks=max_tasks)
