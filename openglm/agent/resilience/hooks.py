"""The resilience layer plugged into the agent runtime through its hooks (docs/agent.md).

    AgentConfig(hooks=["openglm.agent.resilience.hooks:factory"], resilience={...})

- model wrapper: L1 retries with backoff and L2 fallback model around every model call; past L2 the
  task is safely paused ("model unavailable"); the monitor's outage action prefers the fallback;
- tool wrapper: L1 retries for hung (timed-out) commands;
- step callback: verification, stuck detection and the ladder's L2..L5 (guard.py);
- monitor: the resource monitor on the running command's process tree, readings into the task
  status and Prometheus, actions into the task (throttle, restart from snapshot, fallback, pause);
- budget check: tokens and cost against the task's `max_tokens` / `max_cost` constraints (re-read
  every step, so raising them works on a running task); the wall clock is the runtime's timeout;
- routes and metrics: `POST /v1/tasks/{id}/budget` and the Prometheus registry, which the task API
  serves through the hooks (`GET /metrics`).

Also in this module:

- Prometheus metrics of the resilience layer (one registry, labelled by task).

- Raising a task's budgets (timeout, max_tokens, max_cost) while it runs or is paused.
"""

from __future__ import annotations

import dataclasses
import time

import psutil
from fastapi import Body
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from openglm.agent.hooks import Hooks
from openglm.agent.llm import FallbackModel, ModelError
from openglm.agent.process import read_pgid, running_pidfile
from openglm.agent.task import TERMINAL, ConstraintError, TaskState, parse_constraints
from openglm.util.proc import stop_group

from .config import Action, BudgetConfig, ResilienceConfig
from .guard import BudgetTracker, Guard
from .ladder import Escalation, Failure, call_with_recovery
from .monitor import ResourceMonitor, renice_tree


# Reading field -> (metric name, help)
GAUGES = {
    "cpu_percent": ("openglm_task_cpu_percent", "CPU of the task's process tree, percent of its allotment"),
    "rss_bytes": ("openglm_task_rss_bytes", "Resident memory of the task's process tree"),
    "rss_growth_short": ("openglm_task_rss_growth_bytes_per_second", "Robust RSS growth rate, short window"),
    "rss_growth_long": ("openglm_task_rss_growth_long_bytes_per_second", "Robust RSS growth rate, long window"),
    "open_files": ("openglm_task_open_files", "Open file descriptors of the task's process tree"),
    "disk_free_bytes": ("openglm_task_disk_free_bytes", "Free space on the workspace volume"),
    "endpoint_latency_s": ("openglm_model_endpoint_latency_seconds", "Latency of the model endpoint probe"),
    "endpoint_up": ("openglm_model_endpoint_up", "1 when the model endpoint answers"),
    "gpu_ecc_errors": ("openglm_gpu_ecc_errors", "Uncorrected volatile ECC errors of the GPUs"),
    "machine_cpu_percent": ("openglm_machine_cpu_percent", "CPU of the whole machine"),
}


class ResilienceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.gauges = {k: Gauge(name, doc, ["task"], registry=self.registry) for k, (name, doc) in GAUGES.items()}
        self.alerts = Counter("openglm_resilience_actions", "Monitor actions taken", ["task", "metric", "action"],
                              registry=self.registry)
        self.escalations = Counter("openglm_recovery_escalations", "Recovery ladder decisions",
                                   ["task", "level", "error_class"], registry=self.registry)
        self.stuck = Counter("openglm_stuck_detections", "Stuck loops detected", ["task", "kind"],
                             registry=self.registry)

    def observe(self, task: str, reading: dict):
        for key, gauge in self.gauges.items():
            value = reading.get(key)
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, (int, float)):
                gauge.labels(task=task).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_KEYS = {"timeout": "timeout_s", "max_tokens": "max_tokens", "max_cost": "max_cost"}


def raise_budget(store, task_id: str, **caps) -> dict:
    """Set new caps (only upwards); a running task's budget check re-reads them before its next step.

    caps: timeout ("8h", seconds), max_tokens, max_cost. Returns the task's new constraints.
    """
    task = store.get_task(task_id)
    if TaskState(task.state) in TERMINAL:
        raise ConstraintError("state", f"task {task_id} is {task.state}: budgets can be raised only before it ends")
    caps = {k: v for k, v in caps.items() if v is not None}
    unknown = set(caps) - set(_KEYS)
    if unknown or not caps:
        raise ConstraintError("budget", f"give one or more of {sorted(_KEYS)} (got {sorted(caps) or 'none'})")
    old = task.parsed_constraints
    merged = {**task.constraints, **caps}
    new = parse_constraints(merged)  # validates the values, naming the field
    for key, attr in _KEYS.items():
        before, after = getattr(old, attr), getattr(new, attr)
        if key in caps and before is not None and after < before:
            raise ConstraintError(f"constraints.{key}", f"can only be raised: {caps[key]!r} is below the current cap")
    store.append(task_id, [("budget_raised", task.step, {"caps": caps})], {"constraints": merged})
    return merged


METRICS = ResilienceMetrics()  # one registry per process; the agent server exposes it at /metrics


def factory(agent_config=None) -> "ResilienceHooks":
    raw = getattr(agent_config, "resilience", None)
    return ResilienceHooks(ResilienceConfig.from_dict(raw) if isinstance(raw, dict) else raw)


def add_routes(app, store) -> None:
    """The task API's resilience routes: raising a task's budget."""

    @app.post("/v1/tasks/{task_id}/budget")
    def budget(task_id: str, caps: dict = Body(...)):
        """Raise timeout / max_tokens / max_cost of a running or paused task."""
        return {"constraints": raise_budget(store, task_id, **caps)}


class ResilienceHooks(Hooks):
    """The runtime's hooks filled by the resilience layer. Each run's `Guard` (ladder, stuck
    detection, plan) lives in the run's context (`ctx.extensions["resilience"]`), so it goes with
    the run."""

    def __init__(self, config: ResilienceConfig | None = None, sleep=time.sleep):
        self.config = config or ResilienceConfig()
        self.sleep = sleep
        super().__init__(model_wrappers=[self.wrap_model], tool_wrappers=[self.wrap_tool],
                         step_callbacks=[self.on_step], monitors=[self.start_monitor], budgets=[self.check_budget],
                         routes=[add_routes], metrics=[METRICS.render])

    def guard(self, ctx) -> Guard:
        if "resilience" not in ctx.extensions:
            ctx.extensions["resilience"] = Guard(ctx, self.config, METRICS)
        return ctx.extensions["resilience"]

    def wrap_model(self, call, ctx):
        guard = self.guard(ctx)

        def resilient(messages, tools):
            model = ctx.model
            if isinstance(model, FallbackModel):  # the ladder owns the fallback (L2), after L1's retries
                options = [lambda: model.primary.query(messages, tools), lambda: model.fallback.query(messages, tools)]
                if guard.prefer_fallback:  # the monitor saw the primary endpoint down
                    options.reverse()
            else:
                options = [lambda: call(messages, tools)]
            try:
                return call_with_recovery(options, guard.call_ladder, sleep=self.sleep, can_rollback=False,
                                          on_switch=lambda i: guard.event("model_switch", {"to": i}))
            except Escalation as esc:  # past L2 nothing in the workspace helps: pause safely, resume later
                guard.call_ladder.abort("safe pause")
                tried = "retries and the fallback" if isinstance(model, FallbackModel) else \
                    "retries (no fallback model configured)"
                raise ModelError(f"no model answered after {tried}: {esc.error}") from esc.error

        return resilient

    def wrap_tool(self, call, ctx):
        guard = self.guard(ctx)

        def resilient(name, args):
            result = call(name, args)
            attempt = 0
            while self.config.guard.tool_retry and result.meta.get("killed") == "timeout" and attempt < 10:
                decision = guard.call_ladder.on_failure(Failure("transient", f"{name} hung: {str(args)[:200]}"))
                if decision.level.value != 1:
                    guard.call_ladder.abort("returned to the step")
                    break
                self.sleep(decision.delay_s)
                attempt += 1
                result = call(name, args)
            if attempt and result.meta.get("killed") != "timeout":
                guard.call_ladder.on_success()
            return result

        return resilient

    def on_step(self, ctx, record):
        self.guard(ctx).on_step(ctx, record)

    def start_monitor(self, ctx):
        """Started with the run: the guard's state, and the resource monitor unless disabled."""
        guard = self.guard(ctx)
        guard.start()
        return _TaskMonitor(ctx, guard, self.config) if self.config.monitor_enabled else _NoMonitor()

    def check_budget(self, ctx) -> str | None:
        task = ctx.store.get_task(ctx.task_id)
        caps = task.parsed_constraints
        ctx.constraints.timeout_s = caps.timeout_s  # raised while running: the loop sees it now
        price_in, price_out = self.config.guard.price_per_mtok
        tracker = BudgetTracker(BudgetConfig(max_tokens=caps.max_tokens, max_cost=caps.max_cost))
        tracker.charge(task.prompt_tokens, task.completion_tokens,
                       cost=(task.prompt_tokens * price_in + task.completion_tokens * price_out) / 1e6)
        over = tracker.exceeded()
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
            touched += _halve_affinity(pid)
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


def _halve_affinity(pid: int) -> list[int]:
    out = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            cpus = p.cpu_affinity()
            if len(cpus) > 1:
                p.cpu_affinity(cpus[: len(cpus) // 2])
                out.append(p.pid)
        except (psutil.Error, AttributeError):
            continue
    return out
