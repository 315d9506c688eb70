"""Task operations shared by the HTTP API and the CLI: submit, pause, resume, cancel, answer, rollback.

Each change is one guarded store write (`expect_state`), so it cannot race a worker's claim; a
running task is paused or cancelled through `control`, which its worker honours between steps
(a cancel also kills the running command).

A task's `repo` is cloned by the worker that runs it (`clone_workspace`), never while a submit request
waits; what an API client may name as workspace or repo is checked by `check_client_paths`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from openglm.agent.config import AgentConfig
from openglm.agent.llm import ModelSpec
from openglm.agent.snapshot import Snapshots
from openglm.agent.state import rebuild
from openglm.agent.store import StateConflict
from openglm.agent.task import TERMINAL, ConstraintError, Task, TaskState, new_task_id, parse_constraints
from openglm.agent.trust import check_no_secrets, redact, resolve_model_spec
from openglm.util.git import GitError, clone

S = TaskState
_GIT_URL = re.compile(r"^(https?://|ssh://|git://|file://|git@)|\.git/?$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://|^[^/]*@[^/]*:", re.I)  # scheme://... or scp-like user@host:path
MAX_OBJECTIVE_CHARS = 200_000


def _workspace(config: AgentConfig, task_id: str, workspace: str | None, repo: str | None) -> str:
    dest = Path(config.data_dir).resolve() / "workspaces" / task_id
    if repo:
        if not isinstance(repo, str) or not repo.strip():
            raise ConstraintError("repo", f"expected a git URL or a path, got {repo!r}")
        if not _URL.search(repo) and not Path(repo).expanduser().is_dir():
            raise ConstraintError("repo", f"{repo!r} is not a URL and not an existing directory")
        return str(dest)  # the worker clones it there
    if workspace is None:
        dest.mkdir(parents=True, exist_ok=True)
        return str(dest)
    if not isinstance(workspace, str) or not workspace:
        raise ConstraintError("workspace", f"expected a directory path, got {workspace!r}")
    path = Path(workspace).expanduser()
    if not path.is_dir():
        raise ConstraintError("workspace", f"{workspace!r} does not exist or is not a directory")
    return str(path.resolve())


def allowed_roots(config: AgentConfig) -> list[Path]:
    """Where an API client's workspace (or local repo) may lie: the data dir and `workspace_roots`."""
    return [Path(config.data_dir).resolve(), *(Path(r).expanduser().resolve() for r in config.workspace_roots)]


def check_client_paths(config: AgentConfig, workspace: str | None, repo: str | None) -> None:
    """What an API client may ask for: a workspace inside an allowed root; a repo that is a local path
    inside one, or an https URL on an allowed host (no credentials, no other port or scheme)."""
    if isinstance(workspace, str) and workspace and _GIT_URL.search(workspace):
        workspace, repo = None, workspace
    for field, value in (("workspace", workspace), ("repo", repo)):
        if not isinstance(value, str) or not value:
            continue
        if field == "repo" and _URL.search(value):
            _check_clone_url(config, value)
            continue
        path = Path(value).expanduser().resolve()
        if not any(path == root or root in path.parents for root in allowed_roots(config)):
            roots = ", ".join(str(r) for r in allowed_roots(config))
            raise ConstraintError(field, f"{value!r} is outside the folders this server lets clients use ({roots}); "
                                         "start the agent-server with --workspace-root to allow more")


def _check_clone_url(config: AgentConfig, url: str) -> None:
    parts = urlsplit(url) if "://" in url else None
    if parts is None or parts.scheme.lower() != "https":
        raise ConstraintError("repo", f"{url!r}: only https:// repository URLs are cloned")
    host = (parts.hostname or "").lower()
    if parts.username or parts.password or parts.port not in (None, 443):
        raise ConstraintError("repo", f"{url!r}: a repository URL may not carry credentials or a port")
    if host not in {h.lower() for h in config.clone_hosts}:
        raise ConstraintError("repo", f"{host or url!r} is not one of the hosts this server clones from "
                                      f"({', '.join(config.clone_hosts) or 'none'}; AgentConfig.clone_hosts)")


def clone_workspace(config: AgentConfig, task: Task) -> None:
    """Clone a task's repo into its workspace (a worker does this before the first step). Into a
    temporary folder first: a clone killed half-way is never taken for a workspace. GitError with a
    message that names the repo but not what its server answered (that may be an internal one)."""
    repo, dest = task.meta["repo"], Path(task.workspace)
    tmp = dest.with_name(dest.name + ".cloning")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    source = repo if _URL.search(repo) else str(Path(repo).expanduser().resolve())
    try:
        # no redirects: an allowed host must not hand the fetch on to an address the server can reach
        clone(source, tmp, "--no-recurse-submodules", "--config", "http.followRedirects=false",
              timeout=config.clone_timeout_s)
    except GitError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"agent: cloning {repo} for task {task.id} failed: {e.reason}", file=sys.stderr, flush=True)
        why = "timed out" if "timed out" in e.reason else "git could not fetch it"
        raise GitError(f"cannot clone {repo!r}: {why} (the server log has git's message)") from None
    os.replace(tmp, dest)


def submit(store, config: AgentConfig, objective: str, workspace: str | None = None, constraints: dict | None = None,
           repo: str | None = None, model: dict | None = None) -> Task:
    if not isinstance(objective, str) or not objective.strip():
        raise ConstraintError("objective", "must be a non-empty string")
    if len(objective) > MAX_OBJECTIVE_CHARS:
        raise ConstraintError("objective", f"has {len(objective)} characters, more than {MAX_OBJECTIVE_CHARS}: "
                                           "put long material in a file in the workspace")
    parsed = parse_constraints(constraints)  # validate now: 422 at submit, never a failure hours later
    if parsed.network and not config.sandbox.allow_network:
        raise ConstraintError("constraints.network", "this server does not let tasks use the network "
                                                     "(its sandbox.allow_network is false)")
    if model is not None:
        check_no_secrets(model)  # API clients are also held to the allow-lists (trust.check_model_spec)
        _check_model(resolve_model_spec(model))
    task_id = new_task_id()
    created = Path(config.data_dir).resolve() / "workspaces" / task_id  # made here only for repo/no workspace
    if isinstance(workspace, str) and _GIT_URL.search(workspace):
        workspace, repo = None, workspace
    task = Task(id=task_id, objective=objective, workspace=_workspace(config, task_id, workspace, repo),
                constraints=dict(constraints or {}),
                meta={**({"model": model} if model else {}), **({"repo": repo} if repo else {})})
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
