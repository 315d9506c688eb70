"""What `openglm agent-server` says when it is listening: where (the task API and the dashboard), on
which store, with which workers and model, who may use it, and what it will log. Secrets (the tokens,
a password in the store URL, the model's key) are never printed."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit, urlunsplit

from openglm.agent.config import AgentConfig
from openglm.util.sandbox import status as sandbox_status


def base_url(host: str, port: int) -> str:
    """The URL a browser or client on this machine (loopback, a named host) or elsewhere (a wildcard
    address: this machine's name) uses to reach the server."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _store_url(config: AgentConfig) -> str:
    """The store URL without its user and password."""
    url = config.store_url
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return url
    parts = urlsplit(url)
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _model(config: AgentConfig) -> str:
    spec = config.model
    if spec is None:
        return "none configured: a task without its own model spec fails (give --model-url/--model or --replay)"
    text = f"replay {spec.replay}" if spec.replay else f"{spec.model} at {spec.base_url}"
    return text + (f", fallback {spec.fallback.model} at {spec.fallback.base_url}" if spec.fallback else "")


def _auth(host: str, token: str | None, view_token: str | None) -> str:
    if token:
        return ("bearer token: every /v1 route needs `Authorization: Bearer <token>`"
                + ("; the read-only view token may use the GET routes" if view_token else ""))
    return "none: loopback only, anyone on this machine may use it (--token-file requires a key)"


def banner(config: AgentConfig, host: str, port: int, workers: int, token: str | None, view_token: str | None,
           log_level: str) -> str:
    url = base_url(host, port)
    where = f" (listening on all interfaces, {host or '*'}:{port})" if host in ("0.0.0.0", "::", "") else ""
    store = _store_url(config)
    lines = [f"openglm agent-server: {url}{where}; Ctrl+C stops it",
             f"  dashboard  {url}/ui/" + ("#token=<your token> (once: the tab keeps it)" if token else ""),
             f"  task API   {url}/v1/tasks  (openglm task ... --server {url}, or OPENGLM_AGENT_URL)",
             "  store      " + (f"{store} (Redis)" if "://" in store else f"{os.path.abspath(store)} (SQLite)"),
             f"  data dir   {os.path.abspath(config.data_dir)}",
             "  workers    " + (f"{workers} embedded" if workers > 0 else
                                f"none embedded (API only: start `openglm worker --store {store}`)"),
             f"  model      {_model(config)}",
             f"  auth       {_auth(host, token, view_token)}",
             f"  sandbox    {sandbox_status(config.sandbox)}",
             f"  log level  {log_level}" + (": one line per request (--log-level warning hides them)"
                                            if log_level in ("info", "debug") else ": requests are not logged")]
    return "\n".join(lines)
