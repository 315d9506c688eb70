"""Helpers shared by the agent tests."""

from openglm.agent.llm import ReplayModel
from openglm.agent.worker import Worker


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def turn(*calls, content="") -> dict:
    return {"content": content, "tool_calls": list(calls)}


def make_worker(config, store, turns, **kw) -> Worker:
    return Worker(config, store=store, model=ReplayModel(turns), **kw)


def write_script(path, turns) -> str:
    import json

    with open(path, "w") as f:
        for t in turns:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    return str(path)


class AgentServer:
    """A real `openglm agent-server` subprocess (uvicorn on 127.0.0.1, a free port)."""

    def __init__(self, tmp_path, port: int, replay: str, token: str | None = None, workers: int = 1,
                 extra_args: tuple = ()):
        import os
        import subprocess
        import sys

        self.url = f"http://127.0.0.1:{port}"
        self.data_dir = tmp_path / "server-data"
        cmd = [sys.executable, "-m", "openglm.agent", "agent-server", "--port", str(port), "--data-dir", str(self.data_dir),
               "--replay", replay, "--workers", str(workers), "--lease-ttl", "3", *extra_args]
        env = dict(os.environ, OPENGLM_AGENT_TOKEN=token or "")
        self.proc = subprocess.Popen(cmd, env=env, cwd=tmp_path)

    def wait_ready(self, timeout=30):
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "agent-server exited"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError("agent-server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
