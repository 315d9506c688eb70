"""Python client for the openglm agent task API — the write-up's `GLMClient` (001 §6.2):

    client = GLMClient("http://localhost:8000")
    task_id = client.submit_long_task(objective="...", constraints={"timeout": "8h", ...})
    status = client.get_task_status(task_id)   # status["state"] in QUEUED ... SUCCEEDED ...
"""

from __future__ import annotations

import json
import os
import time

import httpx


class GLMClientError(RuntimeError):
    def __init__(self, status_code: int, detail):
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


class GLMClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8100", api_key: str | None = None, timeout: float = 30.0):
        token = api_key or os.environ.get("OPENGLM_AGENT_TOKEN")
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def _call(self, method: str, path: str, **kw):
        r = self.http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json()
            except ValueError:
                detail = r.text
            raise GLMClientError(r.status_code, detail)
        return r.json()

    def submit_long_task(self, objective: str, constraints: dict | None = None, workspace: str | None = None,
                         repo: str | None = None, model: dict | None = None) -> str:
        body = {"objective": objective, "constraints": constraints, "workspace": workspace, "repo": repo,
                "model": model}
        return self._call("POST", "/v1/tasks", json={k: v for k, v in body.items() if v is not None})["task_id"]

    def get_task_status(self, task_id: str) -> dict:
        return self._call("GET", f"/v1/tasks/{task_id}")

    def list_tasks(self) -> list[dict]:
        return self._call("GET", "/v1/tasks")["tasks"]

    def get_events(self, task_id: str, after: int = 0, limit: int = 100) -> list[dict]:
        return self._call("GET", f"/v1/tasks/{task_id}/events", params={"after": after, "limit": limit})["events"]

    def stream_events(self, task_id: str, after: int = 0):
        """Yield events as they happen (SSE) until the task ends."""
        with self.http.stream("GET", f"/v1/tasks/{task_id}/events", params={"after": after, "stream": "true"},
                              timeout=None) as r:
            if r.status_code >= 400:
                raise GLMClientError(r.status_code, r.read().decode())
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "seq" in data:
                        yield data

    def pause(self, task_id: str) -> dict:
        return self._call("POST", f"/v1/tasks/{task_id}/pause")

    def resume(self, task_id: str) -> dict:
        return self._call("POST", f"/v1/tasks/{task_id}/resume")

    def cancel(self, task_id: str) -> dict:
        return self._call("POST", f"/v1/tasks/{task_id}/cancel")

    def answer(self, task_id: str, answer: str) -> dict:
        return self._call("POST", f"/v1/tasks/{task_id}/answer", json={"answer": answer})

    def snapshots(self, task_id: str) -> list[dict]:
        return self._call("GET", f"/v1/tasks/{task_id}/snapshots")["snapshots"]

    def rollback(self, task_id: str, step: int) -> dict:
        return self._call("POST", f"/v1/tasks/{task_id}/rollback", json={"step": step})

    def trajectory(self, task_id: str) -> dict:
        """Each model turn's prompt, reply, tool calls and results, verdicts (the dashboard's viewer data)."""
        return self._call("GET", f"/v1/dash/tasks/{task_id}/trajectory")

    def wait(self, task_id: str, poll: float = 1.0, timeout: float | None = None,
             until=("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT", "PAUSED", "NEEDS_INPUT")) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.get_task_status(task_id))["state"] not in until:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"task {task_id} still {status['state']} after {timeout}s")
            time.sleep(poll)
        return status
