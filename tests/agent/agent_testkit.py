"""The agent tests' kit: scripted turns and models, workers (plain or with the resilience layer), the
event log, and a real agent-server subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from openglm.agent.llm import ReplayModel
from openglm.agent.llm.base import ModelError, ModelResponse, ToolCall
from openglm.agent.resilience import Action, LadderConfig, LadderPolicy, MonitorConfig, ResilienceConfig, Threshold
from openglm.agent.resilience.config import MB, GuardConfig, _default_policies
from openglm.agent.resilience.hooks import ResilienceHooks
from openglm.agent.worker import Worker


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def bash(command):
    return call("bash", command=command)


def turn(*calls, content="") -> dict:
    return {"content": content, "tool_calls": list(calls)}


def write_script(path, turns) -> str:
    with open(path, "w") as f:
        for t in turns:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    return str(path)


class ScriptedModel:
    """Serves its turns in order, one per call, whatever the context (a rollback does not rewind it,
    unlike the replay model). A turn may be a callable(messages) -> turn, or an Exception to raise."""

    name = "scripted"

    def __init__(self, turns, tokens=(30, 10)):
        self.turns, self.calls, self.seen, self.tokens = list(turns), 0, [], tokens

    def query(self, messages, tools=None):
        self.seen.append(messages)
        if self.calls >= len(self.turns):
            raise ModelError(f"script exhausted after {len(self.turns)} turns")
        turn = self.turns[self.calls]
        self.calls += 1
        turn = turn(messages) if callable(turn) else turn
        if isinstance(turn, Exception):
            raise turn
        calls = [ToolCall(c["name"], c.get("arguments", {}), id=f"c{self.calls}_{i}")
                 for i, c in enumerate(turn.get("tool_calls", []))]
        return ModelResponse(turn.get("content", ""), calls, self.tokens[0], self.tokens[1], self.name)


def make_worker(config, store, turns, **kw) -> Worker:
    """A worker whose model replays `turns` (following the conversation, as a resumed run does)."""
    return Worker(config, store=store, model=ReplayModel(turns), **kw)


def fast_config(**guard) -> ResilienceConfig:
    """Compressed time: 20 Hz sampling, a 2 s leak window at 10 MB/s (10 MB/min x 60), no backoff waits."""
    policies = {k: LadderPolicy(**{**p.__dict__, "backoff_s": 0.01}) for k, p in _default_policies().items()}
    thresholds = {"rss_growth_short": Threshold(10 * MB, Action.RESTART_TREE, sustain=20, cooldown_s=1.0),
                  "cpu_percent": Threshold(25.0, Action.REDUCE_PARALLELISM, sustain=3, cooldown_s=30.0),
                  "disk_free_bytes": None}
    return ResilienceConfig(monitor=MonitorConfig(interval_s=0.05, short_window_s=2.0, long_window_s=60.0,
                                                  cpu_allotment=1, thresholds=thresholds),
                            ladder=LadderConfig(policies=policies), guard=GuardConfig(**guard))


def resilient_worker(config, store, model, rcfg=None) -> Worker:
    """A worker with the resilience layer's hooks (`fast_config` unless given)."""
    return Worker(config, store=store, model=model, hooks=ResilienceHooks(rcfg or fast_config()))


def events(store, task_id, kind=None) -> list:
    return [e for e in store.all_events(task_id) if kind is None or e.kind == kind]


def kinds(store, task_id) -> list[str]:
    return [e.kind for e in store.all_events(task_id)]


def dump(store, task_id) -> str:
    return "\n".join(f"{e.step} {e.kind} {json.dumps(e.data)[:200]}" for e in store.all_events(task_id))


class AgentServer:
    """A real `openglm agent-server` subprocess (uvicorn on 127.0.0.1, a free port)."""

    def __init__(self, tmp_path, port: int, replay: str, token: str | None = None, workers: int = 1,
                 extra_args: tuple = ()):
        self.url = f"http://127.0.0.1:{port}"
        self.data_dir = tmp_path / "server-data"
        cmd = [sys.executable, "-m", "openglm.agent", "agent-server", "--port", str(port), "--data-dir",
               str(self.data_dir), "--replay", replay, "--workers", str(workers), "--lease-ttl", "3",
               "--workspace-root", str(tmp_path), *extra_args]
        env = dict(os.environ, OPENGLM_AGENT_TOKEN=token or "")
        self.proc = subprocess.Popen(cmd, env=env, cwd=tmp_path)

    def wait_ready(self, timeout=30):
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
