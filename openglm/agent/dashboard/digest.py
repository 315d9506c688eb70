"""What the tasks page shows of one task, folded incrementally from its event log.

A `Digest` reads each event once (the hub feeds it the new ones), so listing a thousand tasks
every half second costs one store query per task with new events, not a re-read of every log.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from openglm.agent.task import TERMINAL, ConstraintError, Task, parse_constraints

MAX_ALERTS = 50  # newest alerts kept per task


@dataclass
class Digest:
    after: int = 0  # last seq folded in
    last_event_ts: float = 0.0
    last_event_kind: str = ""
    phase: str = ""
    phase_data: dict = field(default_factory=dict)
    phase_budget: dict | None = None  # {"steps", "minutes"}, when the policy's phase events carry one
    committed_steps: int = 0
    crossed: dict = field(default_factory=dict)  # metric -> crossing (not cleared yet)
    alerts: deque = field(default_factory=lambda: deque(maxlen=MAX_ALERTS))

    def fold(self, events) -> None:
        for e in events:
            self.after = e.seq
            self.last_event_ts, self.last_event_kind = e.ts, e.kind
            d = e.data if isinstance(e.data, dict) else {}
            if e.kind == "phase":
                self.phase, self.phase_data = str(d.get("phase", "")), d.get("data") or {}
                self.phase_budget = d.get("budget") if isinstance(d.get("budget"), dict) else None
            elif e.kind == "step_committed" and e.step > 0:
                self.committed_steps += 1
            elif e.kind == "resource_threshold_crossed":
                self.crossed[d.get("metric", "?")] = {"ts": e.ts, **d}
            elif e.kind == "resource_threshold_cleared":
                self.crossed.pop(d.get("metric", "?"), None)
            elif e.kind == "resource_monitor_action":
                self._alert(e, "warning", f"{d.get('metric')}={_short(d.get('value'))} over {_short(d.get('limit'))}: "
                                          f"{d.get('action')} ({d.get('outcome', '')})",
                            metric=d.get("metric"), value=d.get("value"), limit=d.get("limit"),
                            action=f"{d.get('action')} ({d.get('outcome', '')})")
            elif e.kind == "answer":  # the question is answered: its alert is history
                self.alerts = deque((a for a in self.alerts if a["level"] != "input"), maxlen=MAX_ALERTS)
            elif e.kind == "recovery_escalation":
                self._alert(e, "warning",
                            f"recovery L{d.get('level')} for {d.get('error_class')}: {d.get('cause', '')}")
            elif e.kind == "budget_exhausted":
                self._alert(e, "error", f"budget exhausted: {d}")
            elif e.kind == "state" and d.get("state") != "QUEUED":  # the run ended: its monitor with it
                self.crossed.clear()
            if e.kind == "state" and d.get("state") == "QUEUED":  # resumed: why it was paused is history
                self.alerts = deque((a for a in self.alerts if not a.get("pause")), maxlen=MAX_ALERTS)
            if e.kind == "state" and d.get("state") in ("FAILED", "TIMED_OUT", "NEEDS_INPUT"):
                self._alert(e, "error" if d["state"] != "NEEDS_INPUT" else "input",
                            f"{d['state']}: {d.get('reason', '')}")
            elif e.kind == "state" and d.get("state") == "PAUSED" and _unplanned(str(d.get("reason", ""))):
                self._alert(e, "error", f"PAUSED: {d.get('reason', '')}", pause=True)

    def _alert(self, e, level: str, text: str, **reading):
        self.alerts.append({"ts": e.ts, "seq": e.seq, "step": e.step, "level": level, "kind": e.kind,
                            "text": text[:300], **reading})


def _unplanned(reason: str) -> bool:
    """A pause nobody asked for (model unavailable, disk full, the store, the resource monitor) is an alert;
    a user's pause is not, and a budget's has its own (`budget_exhausted`)."""
    return reason != "paused by request" and not reason.startswith("budget exhausted")


def _short(x):
    if isinstance(x, float):
        return f"{x:.4g}"
    return x


def summary(task: Task, digest: Digest, now: float | None = None) -> dict:
    """One row of the tasks page: state, phase and its budget, time budget, steps, cost, alerts."""
    now = now or time.time()
    try:
        c = parse_constraints(task.constraints)
        timeout, max_steps, max_tokens = c.timeout_s, c.max_steps, c.max_tokens
    except ConstraintError:  # a record written by another version: show it, do not fail the page
        timeout, max_steps, max_tokens = None, 0, None
    finished = task.state in {s.value for s in TERMINAL}
    elapsed = task.active_s
    if task.state == "RUNNING" and task.started_at:  # active_s is written at each step; add the current one
        elapsed = max(elapsed, task.active_s + max(0.0, now - max(digest.last_event_ts, task.started_at)))
    pd = digest.phase_data
    phase_budget = digest.phase_budget
    phase = {"name": digest.phase or task.phase, "steps": pd.get("phase_steps"),
             "elapsed_s": ((elapsed - pd["phase_started_s"])
                           if isinstance(pd.get("phase_started_s"), (int, float)) else None),
             "budget": phase_budget}
    if phase_budget and not finished:  # the larger share of its steps or its minutes spent
        shares = [phase["steps"] / phase_budget["steps"]
                  if phase["steps"] is not None and phase_budget.get("steps") else 0,
                  phase["elapsed_s"] / (60 * phase_budget["minutes"])
                  if phase["elapsed_s"] is not None and phase_budget.get("minutes") else 0]
        phase["used"] = min(1.0, max(shares))
    tokens = task.prompt_tokens + task.completion_tokens
    alerts = list(digest.alerts)
    active = [{"ts": x["ts"], "level": "warning", "kind": "threshold", "step": None, "seq": None,
               "text": f"{m} {_short(x.get('value'))} past {_short(x.get('limit'))}", "metric": m,
               "value": x.get("value"), "limit": x.get("limit"), "action": "crossed"}
              for m, x in digest.crossed.items()]
    return {
        "id": task.id, "objective": task.objective[:300], "state": task.state, "reason": task.reason[:300],
        "control": task.control, "worker": task.worker, "created_at": task.created_at, "updated_at": task.updated_at,
        "phase": phase,
        # a finished task has no time left; the clock runs only while a worker runs the task
        "time": {"elapsed_s": elapsed, "timeout_s": timeout,
                 "remaining_s": None if timeout is None or finished else max(0.0, timeout - elapsed),
                 "used": None if not timeout or finished else min(1.0, elapsed / timeout),
                 "clock": "finished" if finished else "running" if task.state == "RUNNING" else "stopped"},
        "steps": {"committed": task.step, "max": max_steps, "model_calls": task.model_calls},
        "last_activity": {"ts": digest.last_event_ts or task.updated_at, "kind": digest.last_event_kind},
        "cost": {"prompt_tokens": task.prompt_tokens, "completion_tokens": task.completion_tokens,
                 "tokens": tokens, "max_tokens": max_tokens},
        "alerts": active + alerts[-5:][::-1],  # still-crossed thresholds first, then the newest
        "alert_count": len(active) + len(alerts),
        "resources": task.resources,
    }
