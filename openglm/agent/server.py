"""`openglm agent-server`: the task API plus embedded workers in one process; `openglm worker`."""

from __future__ import annotations

import os
import threading

from openglm.agent.api import check_bind, create_app
from openglm.agent.config import AgentConfig
from openglm.agent.store import open_store
from openglm.agent.worker import Worker


def start_workers(config: AgentConfig, n: int, stop: threading.Event) -> list[threading.Thread]:
    threads = []
    for i in range(n):
        worker = Worker(config, store=open_store(config.store_url))
        t = threading.Thread(target=worker.serve, args=(stop,), daemon=True, name=f"agent-worker-{i}")
        t.start()
        threads.append(t)
    return threads


def serve(config: AgentConfig, host: str = "127.0.0.1", port: int = 8100, workers: int = 1,
          token: str | None = None, view_token: str | None = None) -> None:
    import uvicorn  # the server's heavy dependency: loaded when serving

    token = token or os.environ.get("OPENGLM_AGENT_TOKEN") or None
    view_token = view_token or os.environ.get("OPENGLM_AGENT_VIEW_TOKEN") or None
    check_bind(host, token)
    if view_token and not token:
        raise ValueError("a read-only --view-token needs a full --token too (else every caller has full control)")
    stop = threading.Event()
    start_workers(config, workers, stop)
    app = create_app(config, token=token, view_token=view_token)
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
