"""Task operations shared by the HTTP API and the CLI: submit, pause, resume, cancel, answer, rollback.

Each change is one guarded store write (`expect_state`), so it cannot race a worker's claim; a
running task is paused or cancelled through `control`, which its worker honours between steps
(a cancel also kills the running command).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from openglm.agent.config import AgentConfig
from openglm.agent.llm import ModelSpec
from openglm.agent.snapshot import Snapshots
from openglm.agent.state import rebuild
from openglm.agent.store import StateConflict
from openglm.agent.task import TERMINAL, ConstraintError, Task, TaskState, new_task_id, parse_constraints
from openglm.agent.trust import check_no_secrets, redact, resolve_model_spec
from openglm.util.git import GitError, clone

S = TaskState
CLONE_TIMEOUT_S = 600
_GIT_URL = re.compile(r"^(https?://|ssh://|git://|file://|git@)|\.git/?$")


def _workspace(config: AgentConfig, task_id: str, workspace: str | None, repo: str | None) -> str:
    if repo:
        dest = Path(config.data_dir).resolve() / "workspaces" / task_id
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            clone(repo, dest, timeout=CLONE_TIMEOUT_S)
        except GitError as e:
            raise ConstraintError("repo", f"cannot clone {repo!r}: {e.reason}") from None
        return str(dest)
    if workspace is None:
        dest = Path(config.data_dir).resolve() / "workspaces" / task_id
        dest.mkdir(parents=True, exist_ok=True)
        return str(dest)
    if not isinstance(workspace, str) or not workspace:
        raise ConstraintError("workspace", f"expected a directory path, got {workspace!r}")
    if _GIT_URL.search(workspace):
        return _workspace(config, task_id, None, workspace)
    path = Path(workspace).expanduser()
    if not path.is_dir():
        raise ConstraintError("workspace", f"{workspace!r} does not exist or is not a directory")
    return str(path.resolve())


def submit(store, config: AgentConfig, objective: str, workspace: str | None = None, constraints: dict | None = None,
           repo: str | None = None, model: dict | None = None) -> Task:
    if not isinstance(objective, str) or not objective.strip():
        raise ConstraintError("objective", "must be a non-empty string")
    parse_constraints(constraints)  # validate now: 422 at submit, never a failure hours later
    if model is not None:
        check_no_secrets(model)  # API clients are also held to the allow-lists (trust.check_model_spec)
        _check_model(resolve_model_spec(model))
    task_id = new_task_id()
    created = Path(config.data_dir).resolve() / "workspaces" / task_id  # made here only for repo/no workspace
    task = Task(id=task_id, objective=objective, workspace=_workspace(config, task_id, workspace, repo),
                constraints=dict(constraints or {}), meta={"model": model} if model else {})
    try:  # the task row and its first event in one write: no task without a log
        store.create_task(task, [("task_created", 0, {"objective": objective, "workspace": task.workspace,
                                                      "constraints": task.constraints})])
    except BaseException:
        if Path(task.workspace) == created:  # no orphan workspace either
            shutil.rmtree(created, ignore_errors=True)
        raise
    return task


def _check_model(model) -> None:
    try:
        spec = ModelSpec.from_dict(model)
    except (TypeError, ValueError) as e:
        raise ConstraintError("model", str(e)) from None
    if not (spec.replay or (spec.base_url and spec.model)):
        raise ConstraintError("model", "needs 'replay', or 'base_url' and 'model'")


def _transition(store, task_id, frm: set, to: S, reason: str, extra_events=()) -> Task:
    task = store.get_task(task_id)
    fields = {"state": to.value, "reason": reason, "control": "", "worker": "", "phase": to.value.lower()}
    if to in TERMINAL:
        fields["finished_at"] = time.time()
    store.append(task_id, [*extra_events, ("state", task.step, {"state": to.value, "reason": reason})], fields,
                 expect_state={s.value for s in frm})
    return store.get_task(task_id)


def pause(store, task_id: str) -> Task:
    task = store.get_task(task_id)
    if task.state == S.RUNNING.value:
        return store.update_task(task_id, {"control": "pause"}, expect_state={S.RUNNING.value})
    if task.state == S.PAUSED.value:  # already where the caller wants it: nothing to do
        return task
    if task.state != S.QUEUED.value:
        raise StateConflict(f"task {task_id} is {task.state}: only a QUEUED or RUNNING task can be paused")
    return _transition(store, task_id, {S.QUEUED}, S.PAUSED, "paused by request")


def resume(store, task_id: str) -> Task:
    task = store.get_task(task_id)
    if task.state == S.RUNNING.value and task.control == "pause":  # not yet paused: withdraw the request
        return store.update_task(task_id, {"control": ""}, expect_state={S.RUNNING.value})
    return _transition(store, task_id, {S.PAUSED}, S.QUEUED, "resumed by request")


def cancel(store, task_id: str) -> Task:
    task = store.get_task(task_id)
    if task.state == S.RUNNING.value:
        return store.update_task(task_id, {"control": "cancel"}, expect_state={S.RUNNING.value})
    return _transition(store, task_id, {S.QUEUED, S.PAUSED, S.NEEDS_INPUT}, S.CANCELLED, "cancelled by request")


def answer(store, task_id: str, text: str) -> Task:
    if not isinstance(text, str) or not text:
        raise ConstraintError("answer", "must be a non-empty string")
    task = store.get_task(task_id)
    return _transition(store, task_id, {S.NEEDS_INPUT}, S.QUEUED, "answered",
                       [("answer", task.step, {"answer": text, "question": task.reason})])


def rollback(store, config: AgentConfig, task_id: str, step: int) -> Task:
    """Restore the workspace to a committed step; allowed while no worker runs the task."""
    task = store.get_task(task_id)
    if task.state in (S.RUNNING.value, S.QUEUED.value):
        raise StateConflict(f"task {task_id} is {task.state}: pause it before rolling back")
    state = rebuild([], store.all_events(task_id))
    sha = state.steps.get(step)
    if sha is None:
        raise ConstraintError("step", f"{step!r} is not a committed step (have {sorted(state.steps)})")
    snaps = Snapshots(task.workspace, config.task_dir(task_id) / "snapshots.git", config.ignore, track=False)
    snaps.restore(sha)  # one restore: watching the workspace would cost more than it saves
    store.append(task_id, [("rollback", state.step, {"to_step": step, "snapshot": sha, "by": "user"})],
                 {"snapshot": sha}, expect_state={task.state})
    return store.get_task(task_id)


def snapshots(store, task_id: str) -> list[dict]:
    """Every snapshot taken; `kept`: still in the task's history (a rollback discards the later steps,
    which can then no longer be rolled back to)."""
    store.get_task(task_id)
    events = store.all_events(task_id)
    kept = rebuild([], events).steps
    return [{"step": e.step, "snapshot": e.data["id"], "changed": e.data.get("changed", True), "ts": e.ts,
             "kept": kept.get(e.step) == e.data["id"]} for e in events if e.kind == "snapshot"]


def status(store, task_id: str, recent: int = 20) -> dict:
    task = store.get_task(task_id)
    total = store.event_count(task_id)
    events = [e.to_dict() for e in store.events(task_id, after=max(0, total - recent), limit=recent)] if recent else []
    return {**redact(task.to_dict()), "recent_events": events}
