"""The task API's resilience routes."""

from __future__ import annotations

from fastapi import Body

from .budget import raise_budget


def add_routes(app, store) -> None:
    """`POST /v1/tasks/{id}/budget`: raise a task's budget."""

    @app.post("/v1/tasks/{task_id}/budget")
    def budget(task_id: str, caps: dict = Body(...)):
        """Raise timeout / max_tokens / max_cost of a running or paused task."""
        return {"constraints": raise_budget(store, task_id, **caps)}
