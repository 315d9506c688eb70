"""The resilience layer plugged into the agent runtime through its hooks (docs/agent.md).

    AgentConfig(hooks=["openglm.agent.resilience.hooks:factory"], resilience={...})

- model and tool wrappers (calls.py): L1 retries with backoff around every model call (L2: a
  FallbackModel's other model; past it the task is safely paused, "model unavailable") and every
  command the timeout killed; the monitor's outage action makes the fallback model answer first;
- step callback: verification, stuck detection and the ladder's L2..L5 (guard.py);
- monitor: the resource monitor on the running command's process tree, readings into the task
  status and Prometheus, actions into the task (throttle, restart from snapshot, fallback, pause);
- budget check: tokens and cost against the task's `max_tokens` / `max_cost` constraints (re-read
  every step, so raising them works on a running task); the wall clock is the runtime's timeout;
- routes and metrics: `POST /v1/tasks/{id}/budget` (routes.py) and the Prometheus registry
  (metrics.py), which the task API serves through the hooks (`GET /metrics`).
"""

from __future__ import annotations

import dataclasses
import time

from openglm.agent.hooks import Hooks
from openglm.agent.llm import FallbackModel
from openglm.agent.process import read_pgid, running_pidfile
from openglm.util.proc import stop_group

from .budget import task_over_budget
from .calls import ResilientModel, ResilientTools
from .config import Action, ResilienceConfig
from .guard import Guard
from .metrics import METRICS
from .monitor import ResourceMonitor
from .process_tree import halve_affinity, renice_tree
from .routes import add_routes


def factory(agent_config=None) -> "ResilienceHooks":
    raw = getattr(agent_config, "resilience", None)
    return ResilienceHooks(ResilienceConfig.from_dict(raw) if isinstance(raw, dict) else raw)


class ResilienceHooks(Hooks):
    """The runtime's hooks filled by the resilience layer. Each run's `Guard` (ladder, stuck
    detection, plan) lives in the run's context (`ctx.extensions["resilience"]`), so it goes with
    the run."""

    def __init__(self, config: ResilienceConfig | None = None, sleep=time.sleep):
        self.config = config or ResilienceConfig()
        self.sleep = sleep
        super().__init__(model_wrappers=[self.wrap_model], tool_wrappers=[self.wrap_tools],
                         step_callbacks=[self.on_step], monitors=[self.start_monitor], budgets=[self.check_budget],
                         routes=[add_routes], metrics=[METRICS.render])

    def guard(self, ctx) -> Guard:
        if "resilience" not in ctx.extensions:
            ctx.extensions["resilience"] = Guard(ctx, self.config, METRICS)
        return ctx.extensions["resilience"]

    def wrap_model(self, inner, ctx) -> ResilientModel:
        return ResilientModel(inner, self.guard(ctx), self.sleep)

    def wrap_tools(self, inner, ctx) -> ResilientTools:
        return ResilientTools(inner, self.guard(ctx), self.sleep)

    def on_step(self, ctx, record):
        self.guard(ctx).on_step(ctx, record)

    def start_monitor(self, ctx):
        """Started with the run: the guard's state, and the resource monitor unless disabled."""
        guard = self.guard(ctx)
        guard.start()
        return _TaskMonitor(ctx, guard, self.config) if self.config.monitor_enabled else _NoMonitor()

    def check_budget(self, ctx) -> str | None:
        task = ctx.store.get_task(ctx.task_id)
        ctx.constraints.timeout_s = task.parsed_constraints.timeout_s  # raised while running: the loop sees it now
        over = task_over_budget(task, self.config.guard.price_per_mtok)
        if over is None:
            return None
        self.guard(ctx).event("budget_exhausted", over.to_dict())
        return f"budget exhausted: {over} (raise it with POST /v1/tasks/{ctx.task_id}/budget, then resume)"


class _NoMonitor:
    def stop(self):
        pass


class _TaskMonitor:
    """The resource monitor of one run: watches the running command's process group."""

    def __init__(self, ctx, guard: Guard, config: ResilienceConfig):
        self.ctx, self.guard = ctx, guard
        self.pidfile = running_pidfile(ctx.snapshots.git_dir.parent)
        mon_cfg = config.monitor
        primary = getattr(ctx.model, "primary", ctx.model)
        if mon_cfg.endpoint_url is None and getattr(primary, "base_url", None):
            mon_cfg = dataclasses.replace(mon_cfg, endpoint_url=primary.base_url + "/models")
        handlers = {Action.REDUCE_PARALLELISM: self.throttle, Action.RESTART_TREE: self.restart,
                    Action.SWITCH_FALLBACK: self.fallback, Action.CPU_MODE: self.cpu_mode,
                    Action.PAUSE: self.pause, Action.WARN: lambda alert: "warned"}
        self.monitor = ResourceMonitor(mon_cfg, roots=self.roots, workspace=ctx.workspace, on_event=self.on_event,
                                       handlers=handlers, metrics=METRICS, task_id=ctx.task_id,
                                       on_sample=self.on_sample)
        self.monitor.start()

    def roots(self) -> list[int]:
        pgid = read_pgid(self.pidfile)
        return [] if pgid is None else [pgid]

    def on_event(self, kind: str, data: dict):
        if kind == "threshold_cleared" and data["metric"] == "endpoint_latency_s":
            self.guard.prefer_fallback = False
        self.guard.event(f"resource_{kind}", data)

    def on_sample(self, reading: dict):
        self.ctx.readings.update({k: v for k, v in self.monitor.status().items() if k != "t"},
                                 parallelism=self.guard.parallelism.value)

    # -- actions ----------------------------------------------------------------------------------
    def throttle(self, alert) -> str:
        value = self.guard.parallelism.reduce()
        touched = []
        for pid in self.roots():
            touched += renice_tree(pid, 10)
            touched += halve_affinity(pid)
        self.ctx.readings["parallelism"] = value
        return f"parallelism {value}; reniced/narrowed {sorted(set(touched))}"

    def restart(self, alert) -> str:
        pids = self.roots()
        with self.guard.lock:
            self.guard.restart = alert.to_dict()
        for pgid in pids:  # the command's step then commits, and is rolled back to the previous snapshot
            stop_group(pgid)  # its launcher kills the whole tree (setsid children too)
        return f"killed process group(s) {pids}; the step restarts from the last snapshot"

    def fallback(self, alert) -> str:
        if not isinstance(self.ctx.model, FallbackModel):
            return "no fallback model configured: the primary endpoint stays in use"
        self.guard.prefer_fallback = True
        return "fallback model preferred until the primary endpoint answers again"

    def cpu_mode(self, alert) -> str:
        self.ctx.readings["device"] = "cpu"
        return "CPU mode (GPU errors); GPU use is off for the rest of the run"

    def pause(self, alert) -> str:
        self.ctx.request_pause(f"paused by the resource monitor: {alert.metric}={alert.value} (limit {alert.limit})")
        return "pause requested"

    def stop(self):
        self.monitor.stop()
        self.ctx.readings.update({k: v for k, v in self.monitor.status().items() if k != "t"})
