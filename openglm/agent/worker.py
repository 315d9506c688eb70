"""A worker: claims tasks from the store under a lease, heartbeats, and runs them.

A worker that stops heartbeating (killed, frozen, partitioned) loses its lease after
`lease_ttl`; any other worker then claims the task and resumes it from the log. Writes are
fenced by the lease, so the old worker can never write again even if it wakes up.

Store faults never kill the loop: a `StoreUnavailable` (disk full, Redis down) stops the task's
run with nothing written, the worker remembers to record the task as PAUSED with the reason
("store: disk full") and backs off (doubling, up to STORE_BACKOFF_MAX_S), retrying that record
before it claims anything else.
"""

from __future__ import annotations

import errno
import importlib
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path

import psutil

from openglm.agent.config import AgentConfig
from openglm.agent.hooks import Hooks, load_hooks
from openglm.agent.llm import ContextOverflowError, ModelError, ModelSpec, build_model
from openglm.agent.loop import TaskRun
from openglm.agent.policy import ToolCallingPolicy
from openglm.agent.process import kill_leftover_commands
from openglm.agent.service import clone_workspace
from openglm.agent.snapshot import Snapshots
from openglm.agent.store import LeaseLost, StoreUnavailable, TaskNotFound, open_store
from openglm.agent.task import TaskState
from openglm.agent.tools import ToolBox
from openglm.agent.trust import resolve_model_spec
from openglm.util.git import GitError
from openglm.util.sandbox import Sandbox

STORE_BACKOFF_MIN_S, STORE_BACKOFF_MAX_S = 0.5, 30.0
PENDING_RETRY_S = 0.25  # how often a worker retries recording the PAUSED state a store fault interrupted


class Worker:
    def __init__(self, config: AgentConfig, store=None, worker_id: str | None = None, model=None,
                 hooks: Hooks | None = None, policy_factory=None):
        self.config = config
        self.store = store or open_store(config.store_url)
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.model = model
        self.hooks = hooks if hooks is not None else load_hooks(config.hooks, config)
        self.policy_factory = policy_factory or self._load_policy_factory()
        self.store_error: str | None = None  # the last store fault, None once the store answers again
        self.pending_pause: tuple | None = None  # (task id, step, snapshot, reason) still to be recorded
        self.last_beat = time.monotonic()  # the loop's own liveness, for /health

    def _load_policy_factory(self):
        if not self.config.policy:
            return lambda: ToolCallingPolicy(context_limit=self.config.context_limit)
        module, _, name = self.config.policy.partition(":")
        factory = getattr(importlib.import_module(module), name)
        return lambda: factory(self.config)

    def task_dir(self, task_id: str) -> Path:
        return self.config.task_dir(task_id)

    def serve(self, stop: threading.Event | None = None, max_tasks: int | None = None) -> int:
        """Claim and run tasks until `stop` is set (or `max_tasks` runs are done)."""
        stop = stop or threading.Event()
        done, backoff = 0, STORE_BACKOFF_MIN_S
        while not stop.is_set() and (max_tasks is None or done < max_tasks):
            self.last_beat = time.monotonic()
            try:
                self._record_pending_pause()
                ran = self.run_one()
            except StoreUnavailable as exc:
                if self.store_error != str(exc):
                    print(f"worker {self.id}: {exc}; retrying with backoff", file=sys.stderr, flush=True)
                self.store_error = str(exc)
                if self.pending_pause is not None:  # our own task's state first: retry it often, so that
                    stop.wait(PENDING_RETRY_S)      # we record it before a backed-off peer claims the task
                    continue
                stop.wait(backoff)
                backoff = min(backoff * 2, STORE_BACKOFF_MAX_S)
                continue
            self.store_error, backoff = None, STORE_BACKOFF_MIN_S
            if ran is None and self.pending_pause is None:
                stop.wait(self.config.poll_interval)
            elif ran is not None:
                done += 1
        return done

    def _record_pending_pause(self) -> None:
        """Record the PAUSED state a store fault kept us from writing (fenced: if another worker has
        taken the task since, it is theirs and there is nothing to record)."""
        if self.pending_pause is None:
            return
        task_id, step, snapshot, reason = self.pending_pause
        try:
            self.store.append(task_id, [("state", step, {"state": TaskState.PAUSED.value, "reason": reason,
                                                         "snapshot": snapshot})],
                              {"state": TaskState.PAUSED.value, "reason": reason, "worker": "", "control": ""},
                              worker=self.id)
        except (LeaseLost, TaskNotFound):
            pass
        self.pending_pause = None

    def run_one(self) -> str | None:
        task = self.store.claim(self.id, self.config.lease_ttl)
        return None if task is None else self.run_task(task)

    def run_task(self, task) -> str | None:
        """Run a task this worker has claimed; returns the state it ended in (None if the lease was lost)."""
        task_dir = self.task_dir(task.id)
        task_dir.mkdir(parents=True, exist_ok=True)
        kill_leftover_commands(task_dir)
        constraints = task.parsed_constraints
        run = snapshots = sandbox = None
        heartbeat = _Heartbeat(self, task.id)
        try:
            if task.meta.get("repo") and not os.path.isdir(task.workspace):
                try:
                    clone_workspace(self.config, task)
                except GitError as e:
                    return self._stop(task, None, TaskState.FAILED, str(e))
            snapshots = Snapshots(task.workspace, task_dir / "snapshots.git", self.config.ignore)
            sandbox = Sandbox(self.config.sandbox, task.workspace, network=constraints.network,
                              memory_bytes=constraints.resources.memory_bytes, cpus=constraints.resources.cpus,
                              command_timeout_s=constraints.command_timeout_s)
            toolbox = ToolBox(task.workspace, sandbox, constraints.command_timeout_s, self.config.max_output)
            spec = resolve_model_spec(task.meta["model"]) if task.meta.get("model") else None  # key: from env
            model = self.model or build_model(spec or self.config.model or ModelSpec())
            run = TaskRun(self.store, task, self.id, model, toolbox, snapshots, self.policy_factory(), self.hooks)
            heartbeat.start(run.ctx)
            return run.run()
        except LeaseLost:
            return None
        except StoreUnavailable as e:  # nothing was written: record the pause once the store is back
            self._defer_pause(task, run, str(e))
            raise
        except OSError as e:
            if e.errno != errno.ENOSPC:
                return self._stop(task, run, TaskState.FAILED, f"error: {e}")
            return self._stop(task, run, TaskState.PAUSED, f"disk full: {e}")
        except ContextOverflowError as e:  # before ModelError: the model is there, the history is too long
            return self._stop(task, run, TaskState.PAUSED, f"context overflow: {e}")
        except ModelError as e:
            return self._stop(task, run, TaskState.PAUSED, f"model unavailable: {e}")
        except Exception as e:  # a bug or a broken workspace: fail loudly, keep the trace in the log
            traceback.print_exc()
            return self._stop(task, run, TaskState.FAILED, f"{type(e).__name__}: {e}")
        finally:
            heartbeat.stop()
            if sandbox is not None:
                sandbox.close()
            if snapshots is not None:
                snapshots.close()  # its inotify watches count against a per-user limit

    def _defer_pause(self, task, run, reason: str) -> None:
        step = run.state.step if run and run.state else 0
        self.pending_pause = (task.id, max(step, 0), run.state.snapshot if run and run.state else "", reason)

    def _stop(self, task, run, state: TaskState, reason: str) -> str | None:
        step = run.state.step if run and run.state else 0
        snapshot = run.state.snapshot if run and run.state else ""
        try:
            self.store.append(task.id, [("state", max(step, 0), {"state": state.value, "reason": reason,
                                                                   "snapshot": snapshot})],
                              {"state": state.value, "reason": reason, "worker": "", "control": ""}, worker=self.id)
        except (LeaseLost, OSError):
            return None
        except StoreUnavailable as e:
            self._defer_pause(task, run, f"{reason}; {e}")
            raise
        return state.value


class _Heartbeat:
    """Extends the lease every ttl/3 and brings back pause/cancel requests and resource readings."""

    def __init__(self, worker: Worker, task_id: str):
        self.worker, self.task_id = worker, task_id
        self._stop = threading.Event()
        self._thread = None

    def start(self, ctx):
        self._thread = threading.Thread(target=self._loop, args=(ctx,), daemon=True, name=f"heartbeat-{self.task_id}")
        self._thread.start()

    def _loop(self, ctx):
        interval = self.worker.config.lease_ttl / 3
        me = psutil.Process()
        while not self._stop.wait(interval):
            try:
                task = self.worker.store.heartbeat(self.task_id, self.worker.id, self.worker.config.lease_ttl)
                ctx.control = task.control
                readings = {"worker_cpu_percent": me.cpu_percent(), "worker_rss_bytes": me.memory_info().rss,
                            "tools_rss_bytes": sum(_rss(c) for c in me.children(recursive=True)), **ctx.readings}
                self.worker.store.update_task(self.task_id, {"resources": readings}, worker=self.worker.id)
            except LeaseLost:
                ctx.lease_lost = True
                return
            except Exception:  # a store hiccup: try again next beat; the lease has slack
                continue

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(5)


def _rss(p) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0
