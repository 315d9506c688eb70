"""Raising a task's budgets (timeout, max_tokens, max_cost) while it runs or is paused."""

from __future__ import annotations

from openglm.agent.task import TERMINAL, ConstraintError, TaskState, parse_constraints

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
    old = parse_constraints(task.constraints)
    merged = {**task.constraints, **caps}
    new = parse_constraints(merged)  # validates the values, naming the field
    for key, attr in _KEYS.items():
        before, after = getattr(old, attr), getattr(new, attr)
        if key in caps and before is not None and after < before:
            raise ConstraintError(f"constraints.{key}", f"can only be raised: {caps[key]!r} is below the current cap")
    store.append(task_id, [("budget_raised", task.step, {"caps": caps})], {"constraints": merged})
    return merged
