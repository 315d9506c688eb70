"""Python client for the openglm agent task API — the write-ups' `GLMClient` interface:

    client = GLMClient("http://localhost:8100")          # `openglm agent-server`'s default port
    task_id = client.submit_long_task(objective="...", constraints={"timeout": "8h", ...})
    status = client.get_task_status(task_id)   # status["state"] in QUEUED ... SUCCEEDED ...
"""

from __future__ import annotations

import json
import os
import time

import httpx

from openglm.util.ports import AGENT_PORT as DEFAULT_PORT  # noqa: F401 (re-exported here)
from openglm.util.ports import AGENT_URL as DEFAULT_URL


class GLMClientError(RuntimeError):
    """The task API answered with an error (status_code >= 400), or could not be reached (status_code 0)."""

    def __init__(self, status_code: int, detail):
        super().__init__(f"HTTP {status_code}: {detail}" if status_code else str(detail))
        self.status_code, self.detail = status_code, detail


class GLMConnectionError(GLMClientError):
    """No task API answered at the URL (not running, wrong address or port, timed out)."""

    def __init__(self, url: str, error: Exception):
        super().__init__(0, f"cannot reach the task API at {url} ({type(error).__name__}: {error or 'no answer'}); "
                            "is `openglm agent-server` running there? (set --server or OPENGLM_AGENT_URL)")
        self.url = url


class GLMClient:
    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 30.0):
        token = api_key or os.environ.get("OPENGLM_AGENT_TOKEN")
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def _call(self, method: str, path: str, **kw):
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:  # connect refused, DNS, timeouts, dropped connections
            raise GLMConnectionError(self.base_url, e) from e
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
        try:
            with self.http.stream("GET", f"/v1/tasks/{task_id}/events", params={"after": after, "stream": "true"},
                                  timeout=None) as r:
                if r.status_code >= 400:
                    raise GLMClientError(r.status_code, r.read().decode())
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "seq" in data:
                            yield data
        except httpx.TransportError as e:
            raise GLMConnectionError(self.base_url, e) from e

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

    def rollback_preview(self, task_id: str, step: int) -> dict:
        """What rolling back to `step` would change: the snapshot against the workspace as it is now
        (`name_status`, `stat`, `patch`, `files`), the `workspace` and whether the task uses it `in_place`."""
        return self._call("GET", f"/v1/dash/tasks/{task_id}/diff", params={"step": step})

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
