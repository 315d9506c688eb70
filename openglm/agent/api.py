"""The task HTTP API (FastAPI). `openglm agent-server` serves it with embedded workers.

Bad input answers 422 with the offending field named; state conflicts 409; unknown tasks 404.
A bearer token is required on every /v1 route when one is configured, and the server refuses to
bind a non-loopback address without one.
"""

from __future__ import annotations

import json
import time

from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from openglm.agent import dashboard, service
from openglm.agent.config import AgentConfig
from openglm.agent.hooks import Hooks, load_hooks
from openglm.agent.store import StateConflict, StoreUnavailable, TaskNotFound, open_store
from openglm.agent.task import TERMINAL, ConstraintError, TaskState
from openglm.agent.trust import check_model_spec, redact
from openglm.util.auth import Access, access, allows, is_loopback


class SubmitRequest(BaseModel):
    objective: str
    workspace: str | None = None
    repo: str | None = None
    constraints: dict | None = None
    model: dict | None = None


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise ValueError(f"refusing to serve the task API on non-loopback address {host!r} without a bearer token "
                         "(set --token or OPENGLM_AGENT_TOKEN)")


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
               view_token: str | None = None, workers=None) -> FastAPI:
    """The task API over `store`; the hook layers of `config.hooks` (or `hooks`) add their routes and metrics.
    `view_token` (optional) is a read-only key: GET routes only (the dashboard without its controls).
    `workers`: the embedded WorkerPool whose liveness /health reports (None: workers run elsewhere)."""
    store = store or open_store(config.store_url)
    hooks = hooks if hooks is not None else load_hooks(config.hooks, config)
    app = FastAPI(title="openglm agent", version="1")
    app.add_middleware(BearerAuth, token=token, view_token=view_token)
    app.state.store = store

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
        """200 while the store answers and (with embedded workers) at least one worker is alive."""
        body = {"ok": True, "store": "ok"}
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
        task = service.submit(store, config, req.objective, req.workspace, req.constraints, req.repo, req.model)
        return {"task_id": task.id, **redact(task.to_dict())}

    @app.get("/v1/tasks")
    def list_tasks(limit: int = 100):
        return {"tasks": [redact(t.to_dict()) for t in store.list_tasks(limit)]}

    @app.get("/v1/tasks/{task_id}")
    def status(task_id: str, recent: int = 20):
        return service.status(store, task_id, recent)

    @app.get("/v1/tasks/{task_id}/events")
    def events(task_id: str, request: Request, after: int = 0, limit: int = 100, stream: bool = False):
        store.get_task(task_id)
        if stream or "text/event-stream" in request.headers.get("accept", ""):
            return StreamingResponse(_sse(store, task_id, after), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        evs = store.events(task_id, after=after, limit=min(limit, 1000))
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


def _sse(store, task_id: str, after: int, poll: float = 0.2, idle_timeout: float = 3600):
    """Server-sent events: each event as `data: {json}`; ends after the task reaches a terminal state."""
    last_event = last_ping = time.monotonic()
    while True:
        evs = store.events(task_id, after=after, limit=500)
        for e in evs:
            yield f"id: {e.seq}\nevent: {e.kind}\ndata: {json.dumps(e.to_dict(), ensure_ascii=False)}\n\n"
            after = e.seq
        if evs:
            last_event = time.monotonic()
            continue
        state = store.get_task(task_id).state
        if TaskState(state) in TERMINAL:
            yield f"event: end\ndata: {json.dumps({'state': state})}\n\n"
            return
        if time.monotonic() - last_event > idle_timeout:
            return
        if time.monotonic() - last_ping > 15:  # keeps proxies from closing an idle stream
            last_ping = time.monotonic()
            yield ": keep-alive\n\n"
        time.sleep(poll)
