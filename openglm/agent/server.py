"""`openglm agent-server`: the task API plus embedded workers in one process; `openglm worker`."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading

from openglm.agent.api import AGENT_LIMITS, check_bind, create_app
from openglm.agent.config import AgentConfig
from openglm.agent.store import open_store
from openglm.agent.worker import Worker
from openglm.util.http_limits import uvicorn_config
from openglm.util.ports import AGENT_PORT as DEFAULT_PORT
from openglm.util.sandbox import status as sandbox_status

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


def announce_sandbox(config: AgentConfig, who: str) -> None:
    """Say on stderr, where an operator sees it, when tasks' commands are not sandboxed."""
    status = sandbox_status(config.sandbox)
    if status == "bwrap":
        return
    bar = "!" * 100
    if not config.sandbox.enabled:
        text = (f"{who}: WARNING: --unsafe-no-sandbox: tasks' commands run UNCONFINED, as this server's user, with "
                "its files and network. Use it only for tasks you trust.")
    else:
        text = (f"{who}: the sandbox for tasks' commands is {status}. Tasks run, but every command they try is "
                "refused. Install bubblewrap and allow unprivileged user namespaces, or restart with "
                "--unsafe-no-sandbox to run commands unconfined (only for tasks you trust).")
    print(f"{bar}\n{text}\n{bar}", file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one). Bound before anything else starts, so a port in
    use is one line, and the address a start-up banner prints already takes connections."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (socket.gaierror, OSError) as e:
        raise ValueError(f"cannot listen on {host!r}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "in use (another agent-server?): choose another --port" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(config: AgentConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT, workers: int = 1,
          token: str | None = None, view_token: str | None = None, log_level: str = "warning",
          on_listening=None) -> None:
    """Serve until interrupted. `log_level` info (or debug) adds uvicorn's access log, one line per request;
    `on_listening(port)` is called once the socket listens (the CLI prints its banner there)."""
    import uvicorn  # the server's heavy dependency: loaded when serving

    token = token or os.environ.get("OPENGLM_AGENT_TOKEN") or None
    view_token = view_token or os.environ.get("OPENGLM_AGENT_VIEW_TOKEN") or None
    check_bind(host, token)
    if view_token and not token:
        raise ValueError("a read-only --view-token needs a full --token too (else every caller has full control)")
    sock = listen(host, port)
    if workers > 0:
        announce_sandbox(config, "agent-server")
    stop = threading.Event()
    pool = start_workers(config, workers, stop)
    app = create_app(config, token=token, view_token=view_token, host=host,
                     workers=pool if workers > 0 else None)  # 0 workers: API only, /health needs none
    server = uvicorn.Server(uvicorn_config(app, host, sock.getsockname()[1], AGENT_LIMITS, log_level=log_level,
                                           access_log=log_level in ("info", "debug", "trace")))
    if log_level == "info":  # the access log, without uvicorn's start-up chatter (the banner says it)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    if on_listening is not None:
        on_listening(sock.getsockname()[1])
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        sock.close()


def run_worker(config: AgentConfig, max_tasks: int | None = None) -> int:
    # No graceful-stop dance: a killed worker's task is resumed by another once its lease expires.
    announce_sandbox(config, "worker")
    stop = threading.Event()
    worker = Worker(config)
    print(f"worker {worker.id} polling {config.store_url}", flush=True)
    return worker.serve(stop, max_tasks=max_tasks)
