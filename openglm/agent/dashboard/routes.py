"""The dashboard's routes, mounted on the task API app (same port, same bearer token).

Pages and assets under /ui are static shells holding no data (a browser cannot send a bearer
header when it navigates); every piece of data comes from /v1/dash/... (or the task API itself),
which the API's token check covers. Controls use the task API's own POST routes, which a
read-only key cannot call.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from openglm.agent.config import AgentConfig
from openglm.agent.dashboard import export, trajectory
from openglm.agent.dashboard.diff import DiffError, snapshot_vs_workspace
from openglm.agent.dashboard.hub import Hub
from openglm.agent.dashboard.live import Tail
from openglm.agent.policy import ToolCallingPolicy
from openglm.agent.process import live_output_file
from openglm.agent.resilience import ResilienceConfig
from openglm.agent.state import rebuild
from openglm.agent.task import TERMINAL, ConstraintError, TaskState

STATIC = Path(__file__).parent / "static"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def thresholds(config: AgentConfig) -> dict:
    """The monitor's limits (the task's resilience settings, else the write-ups' defaults) for the graphs."""
    try:
        mon = ResilienceConfig.from_dict(config.resilience or {}).monitor
    except (ValueError, TypeError, KeyError):
        mon = ResilienceConfig().monitor
    out = {}
    for metric, th in mon.thresholds.items():
        if th is not None and math.isfinite(th.limit):
            out[metric] = {"limit": th.limit, "action": th.action.value, "floor": metric == "disk_free_bytes"}
    return out


def _stream(request: Request, poll, interval: float, first=()) -> StreamingResponse:
    """SSE: `first`, then what `poll()` returns every `interval` s, until the client leaves or `poll`
    returns None; a comment after 15 quiet seconds keeps proxies from closing the stream."""

    async def frames():
        for frame in first:
            yield frame
        quiet = 0.0
        while not await request.is_disconnected():
            out = poll()
            if out is None:
                yield _sse("end", {})
                return
            for frame in out:
                yield frame
            quiet = 0.0 if out else quiet + interval
            if quiet >= 15:
                quiet = 0.0
                yield ": keep-alive\n\n"
            await asyncio.sleep(interval)

    return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)


def _sse(kind: str, data) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, default=str)}\n\n"


def _initial_messages(config: AgentConfig, task) -> list[dict]:
    """The system + objective messages of the task's policy (the runtime's own, as configured)."""
    policy = ToolCallingPolicy(context_limit=config.context_limit)
    if config.policy:
        module, _, name = config.policy.partition(":")
        try:
            policy = getattr(importlib.import_module(module), name)(config)
        except Exception:  # the viewer still works with the default policy's first messages
            pass
    try:
        return policy.initial_messages(task)
    except Exception:
        return [{"role": "user", "content": f"Objective:\n{task.objective}"}]


def trajectory_of(store, config: AgentConfig, task_id: str) -> dict:
    task = store.get_task(task_id)
    return trajectory.build(task, store.all_events(task_id), _initial_messages(config, task))


def mount(app: FastAPI, store, config: AgentConfig) -> Hub:
    """Add the dashboard to the task API app; returns its hub (started with the server, or on first use)."""
    hub = Hub(store)
    limits = thresholds(config)
    r = APIRouter(prefix="/v1/dash")

    @r.get("/me")
    def me(request: Request):
        return {"control": getattr(request.state, "control", True), "thresholds": limits}

    @r.get("/tasks")
    def tasks():
        hub.start()
        return {"tasks": hub.rows_sorted(), "version": hub.version, "error": hub.error}

    @r.get("/stream")
    async def stream(request: Request):
        await asyncio.to_thread(hub.start)
        version = hub.version
        first = [_sse("rows", {"rows": hub.rows_sorted(), "version": version, "full": True})]

        def poll():
            nonlocal version
            new_version, changed = hub.changes_since(version)
            if not changed:
                return []
            version = new_version
            return [_sse("rows", {"rows": changed, "version": version, "error": hub.error})]

        return _stream(request, poll, 0.25, first)

    @r.get("/tasks/{task_id}")
    def task_view(task_id: str):
        hub.start()
        task = store.get_task(task_id)
        state = rebuild([], store.all_events(task_id))
        row = hub.rows.get(task_id)
        return {"task": task.to_dict(), "row": row, "thresholds": limits,
                "phase": {"name": state.phase or task.phase, "data": state.phase_data},
                "snapshots": [{"step": s, "snapshot": sha} for s, sha in sorted(state.steps.items())],
                "resources": list(hub.history.get(task_id, []))}

    @r.get("/tasks/{task_id}/resources")
    def resources(task_id: str, after: float = 0.0):
        store.get_task(task_id)
        hub.start()
        return {"samples": [s for s in hub.history.get(task_id, []) if s["ts"] > after], "thresholds": limits}

    @r.get("/tasks/{task_id}/output")
    async def output(task_id: str, request: Request):
        task = await asyncio.to_thread(store.get_task, task_id)
        tail = Tail(live_output_file(config.task_dir(task_id)))

        done = TaskState(task.state) in TERMINAL  # a finished task's output is read once, then the stream ends

        def poll():
            started, text = tail.poll()
            frames = ([_sse("reset", started)] if started is not None else []) + (
                [_sse("output", {"text": text})] if text else [])
            return frames or (None if done else [])

        return _stream(request, poll, 0.2)

    @r.get("/tasks/{task_id}/diff")
    def diff(task_id: str, step: int):
        task = store.get_task(task_id)
        sha = rebuild([], store.all_events(task_id)).steps.get(step)
        if sha is None:
            raise ConstraintError("step", f"{step!r} is not a committed step of the current history")
        created = Path(config.data_dir).resolve() / "workspaces" / task_id  # else the user's own folder
        where = {"workspace": task.workspace, "in_place": Path(task.workspace).resolve() != created}
        try:
            return {"step": step, **where, **snapshot_vs_workspace(config.task_dir(task_id).resolve() / "snapshots.git",
                                                                   task.workspace, sha)}
        except DiffError as e:
            return JSONResponse({"detail": str(e)}, status_code=409)

    @r.get("/tasks/{task_id}/trajectory")
    def trajectory_json(task_id: str):
        return trajectory_of(store, config, task_id)

    @r.get("/tasks/{task_id}/export.html")
    def export_html(task_id: str):
        html = export.render(trajectory_of(store, config, task_id))
        return HTMLResponse(html, headers={"Content-Disposition": f'attachment; filename="{task_id}.html"'})

    app.include_router(r)

    @app.get("/", include_in_schema=False)
    def root():
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=STATIC, html=True), name="dashboard")
    # from the server's start, so the resource graphs have history when someone first looks
    app.router.on_startup.append(hub.start)
    app.router.on_shutdown.append(hub.stop)
    app.state.dashboard = hub
    return hub

