"""The task HTTP API (FastAPI). `openglm agent-server` serves it with embedded workers.

Bad input answers 422 with the offending body field named (a query parameter out of range: 400, naming
it); state conflicts 409; unknown tasks 404; a lost or failing store 503.

Who may ask:
  - a bearer token is required on every /v1 route when one is configured, and the server refuses to
    bind a non-loopback address without one;
  - every route checks `Host` (loopback names, the address bound, the configured public names: a page
    that rebinds its own DNS name to this address gets 400) and `Origin` (when a browser sends one, it
    must be this server's: another site's page gets 403);
  - a state-changing request carries a JSON body or none: the encodings a cross-site <form> can send
    (urlencoded, multipart, text/plain) are 415.
What a request may cost (`AGENT_LIMITS`): a 1 MiB body that must arrive within the body deadlines, a
request head within the header timeout, at most `limit_concurrency` connections; paging parameters are
range-checked; event streams are async (a viewer waiting for events holds no thread).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

from fastapi import Body, FastAPI, Query, Request, Response
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from openglm.agent import dashboard, service
from openglm.agent.config import AgentConfig
from openglm.agent.hooks import Hooks, load_hooks
from openglm.agent.store import StateConflict, StoreUnavailable, TaskNotFound, open_store
from openglm.agent.task import TERMINAL, ConstraintError, TaskState
from openglm.agent.trust import check_model_spec, redact
from openglm.util.auth import Access, access, allows, is_loopback
from openglm.util.http_limits import BodyLimit, HTTPLimits, send_json
from openglm.util.sandbox import status as sandbox_status

AGENT_LIMITS = HTTPLimits(max_body_bytes=1 << 20, body_timeout_s=10.0, body_deadline_s=30.0, header_timeout_s=10.0,
                          keep_alive_s=5, limit_concurrency=128)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_PAGE = 1000
MAX_SEQ = 2**62  # event sequence numbers and offsets past this are not numbers a client needs


class SubmitRequest(BaseModel):
    objective: str
    workspace: str | None = None
    repo: str | None = None
    constraints: dict | None = None
    model: dict | None = None


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ValueError(f"refusing to serve the task API on non-loopback address {host!r} without a bearer token "
                         "(set --token-file or OPENGLM_AGENT_TOKEN)")


def host_name(value: str) -> str:
    """The name in a Host header or URL authority, without port or brackets: '[::1]:8100' -> '::1'."""
    value = value.strip().lower().rsplit("@", 1)[-1]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def served_names(config: AgentConfig, host: str | None) -> frozenset[str]:
    """The names a request's Host may carry: loopback's, the address bound (unless a wildcard), the public names."""
    names = set(LOOPBACK_NAMES) | {host_name(n) for n in config.public_names}
    if host and host not in ("0.0.0.0", "::", ""):
        names.add(host_name(host))
    return frozenset(names)


class TrustedRequests:
    """Host and Origin on every request, and no form-encoded state changes (DNS rebinding and cross-site
    requests from a browser). A plain ASGI middleware: it answers before routing or body parsing."""

    def __init__(self, app, names: frozenset[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get(b"host", "")
        if host_name(host) not in self.names:
            return await send_json(send, 400, {"detail": f"the Host header {host[:100]!r} does not name this server "
                                                         f"({', '.join(sorted(self.names))}); start it with "
                                                         "--public-name NAME to serve another name"})
        origin = headers.get(b"origin")
        if origin is not None and not self._same_origin(origin, host):
            return await send_json(send, 403, {"detail": f"a request from the page at {origin[:100]!r} is refused: "
                                                         "only this server's own pages may call it"})
        media = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
        if scope["method"] not in SAFE_METHODS and media and media != "application/json":
            return await send_json(send, 415, {"detail": f"this API takes JSON bodies, not {media[:100]!r}"})
        await self.app(scope, receive, send)

    def _same_origin(self, origin: str, host: str) -> bool:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file: pages) and anything odd
        name = host_name(parts.netloc)
        return parts.netloc.lower() == host.strip().lower() and name in self.names or (
            name in self.names - LOOPBACK_NAMES)  # a public name: behind a proxy the ports may differ


class BearerAuth:
    """Every /v1 route needs the token (GET routes: the token or the read-only view token) when one is
    set; `request.state.control` says whether the caller may use the controls. A plain ASGI middleware:
    it answers before routing or body parsing, and leaves `receive` alone (the event streams see a
    client leave)."""

    def __init__(self, app, token: str | None, view_token: str | None):
        self.app, self.token, self.view_token = app, token, view_token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            level = access(header, self.token, self.view_token)
            refusal = None
            if level is Access.DENIED:
                refusal = JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                                       headers={"WWW-Authenticate": "Bearer"})
            elif not allows(level, scope["method"]):
                refusal = JSONResponse({"detail": "this key is read-only"}, status_code=403)
            if refusal is not None:
                return await refusal(scope, receive, send)
            scope.setdefault("state", {})["control"] = level is Access.CONTROL
        await self.app(scope, receive, send)


def create_app(config: AgentConfig, store=None, token: str | None = None, hooks: Hooks | None = None,
               view_token: str | None = None, workers=None, host: str | None = None,
               limits: HTTPLimits = AGENT_LIMITS) -> FastAPI:
    """The task API over `store`; the hook layers of `config.hooks` (or `hooks`) add their routes and metrics.
    `view_token` (optional) is a read-only key: GET routes only (the dashboard without its controls).
    `workers`: the embedded WorkerPool whose liveness /health reports (None: workers run elsewhere).
    `host`: the address the server binds (a concrete one is a name requests may use); `limits`: the body
    cap and deadlines (serve() gives uvicorn the same for its connection limits)."""
    store = store or open_store(config.store_url)
    hooks = hooks if hooks is not None else load_hooks(config.hooks, config)
    app = FastAPI(title="openglm agent", version="1")
    app.add_middleware(BearerAuth, token=token, view_token=view_token)
    app.add_middleware(BodyLimit, limits=limits)
    app.add_middleware(TrustedRequests, names=served_names(config, host))  # the outermost: checked first
    app.state.store = store
    sandbox = sandbox_status(config.sandbox)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and all(e.get("loc", ("",))[0] in ("query", "path") for e in errors):
            name = ".".join(str(p) for p in errors[0]["loc"][1:])
            return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
                                            for e in errors], "field": name}, status_code=400)
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(ConstraintError)
    async def bad_field(request, exc: ConstraintError):
        loc = ["body", *exc.field.replace("[", ".").replace("]", "").split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": exc.message, "type": "value_error"}], "field": exc.field},
                            status_code=422)

    @app.exception_handler(TaskNotFound)
    async def not_found(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(StateConflict)
    async def conflict(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(StoreUnavailable)
    async def store_down(request, exc: StoreUnavailable):
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "5"})

    @app.get("/health")
    def health():
        """200 while the store answers and (with embedded workers) at least one worker is alive; `sandbox`
        says how tasks' commands are confined."""
        body = {"ok": True, "store": "ok", "sandbox": sandbox}
        try:
            store.check()
        except StoreUnavailable as exc:
            body.update(ok=False, store=str(exc))
        if workers is not None:
            body.update(workers.health())
            body["ok"] = body["ok"] and body["workers_alive"] > 0
        return JSONResponse(body, status_code=200 if body["ok"] else 503)

    @app.post("/v1/tasks", status_code=201)
    def submit(req: SubmitRequest):
        if req.model is not None:  # an API client may only use the server's allow-listed models and files
            check_model_spec(config, req.model)
        service.check_client_paths(config, req.workspace, req.repo)  # and only the allowed folders and hosts
        task = service.submit(store, config, req.objective, req.workspace, req.constraints, req.repo, req.model)
        return {"task_id": task.id, **redact(task.to_dict())}

    @app.get("/v1/tasks")
    def list_tasks(limit: int = Query(100, ge=1, le=MAX_PAGE), offset: int = Query(0, ge=0, le=MAX_SEQ)):
        return {"tasks": [redact(t.to_dict()) for t in store.list_tasks(limit, offset)]}

    @app.get("/v1/tasks/{task_id}")
    def status(task_id: str, recent: int = Query(20, ge=0, le=MAX_PAGE)):
        return service.status(store, task_id, recent)

    @app.get("/v1/tasks/{task_id}/events")
    async def events(task_id: str, request: Request, after: int = Query(0, ge=0, le=MAX_SEQ),
                     limit: int = Query(100, ge=1, le=MAX_PAGE), stream: bool = False):
        await run_in_threadpool(store.get_task, task_id)
        if stream or "text/event-stream" in request.headers.get("accept", ""):
            return StreamingResponse(_sse(store, task_id, after, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        evs = await run_in_threadpool(store.events, task_id, after, limit)
        return {"events": [e.to_dict() for e in evs], "next_after": evs[-1].seq if evs else after}

    @app.post("/v1/tasks/{task_id}/pause")
    def pause(task_id: str):
        return service.pause(store, task_id).to_dict()

    @app.post("/v1/tasks/{task_id}/resume")
    def resume(task_id: str):
        return service.resume(store, task_id).to_dict()

    @app.post("/v1/tasks/{task_id}/cancel")
    def cancel(task_id: str):
        return service.cancel(store, task_id).to_dict()

    @app.post("/v1/tasks/{task_id}/answer")
    def answer(task_id: str, answer: str = Body(..., embed=True)):
        return service.answer(store, task_id, answer).to_dict()

    @app.get("/v1/tasks/{task_id}/snapshots")
    def snapshots(task_id: str):
        return {"snapshots": service.snapshots(store, task_id)}

    @app.post("/v1/tasks/{task_id}/rollback")
    def rollback(task_id: str, step: int = Body(..., embed=True)):
        return service.rollback(store, config, task_id, step).to_dict()

    @app.get("/metrics")
    def metrics():
        """Prometheus metrics of the hook layers (e.g. resilience: resource readings, actions, escalations)."""
        return Response(b"".join(render() for render in hooks.metrics), media_type="text/plain; version=0.0.4")

    for add_routes in hooks.routes:
        add_routes(app, store)
    dashboard.mount(app, store, config)  # pages at /ui/, their data at /v1/dash/ (openglm.agent.dashboard)
    return app


async def _sse(store, task_id: str, after: int, request: Request, poll: float = 0.2, idle_timeout: float = 3600):
    """Server-sent events: each event as `data: {json}`; ends after the task reaches a terminal state, when
    the client leaves, or when the store fails. Waiting holds no thread: only each store read borrows one."""
    last_event = last_ping = time.monotonic()
    while not await request.is_disconnected():
        try:
            evs = await run_in_threadpool(store.events, task_id, after, 500)
            for e in evs:
                yield f"id: {e.seq}\nevent: {e.kind}\ndata: {json.dumps(e.to_dict(), ensure_ascii=False)}\n\n"
                after = e.seq
            if evs:
                last_event = time.monotonic()
                continue
            state = (await run_in_threadpool(store.get_task, task_id)).state
        except StoreUnavailable as exc:
            yield f"event: error\ndata: {json.dumps({'detail': str(exc)})}\n\n"
            return
        if TaskState(state) in TERMINAL:
            yield f"event: end\ndata: {json.dumps({'state': state})}\n\n"
            return
        if time.monotonic() - last_event > idle_timeout:
            return
        if time.monotonic() - last_ping > 15:  # keeps proxies from closing an idle stream
            last_ping = time.monotonic()
            yield ": keep-alive\n\n"
        await asyncio.sleep(poll)
