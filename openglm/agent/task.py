"""The task model: states, constraints ("8h", "16CPU/64GB", deliverables) and the task record."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cached_property


class TaskState(str, Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    NEEDS_INPUT = "NEEDS_INPUT"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"


TERMINAL = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.TIMED_OUT}


class ConstraintError(ValueError):
    """A bad constraint; `field` names it (the API answers 422 with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class Resources:
    cpus: int | None = None
    memory_bytes: int | None = None


@dataclass
class Deliverable:
    """A path that must exist in the workspace ({"path": ...}, or a plain string), or a command that must
    exit 0 there ({"run": ...}; {"command": ...} is the older spelling)."""

    path: str | None = None
    command: str | None = None

    def describe(self) -> str:
        return f"path {self.path}" if self.path else f"run `{self.command}`"


_DURATION_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}
_SIZE_UNITS = {"K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30, "T": 2**40, "TB": 2**40}


def parse_duration(value, field: str = "timeout") -> float:
    """'8h', '90m', '1h30m', '45s' or a number of seconds -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ConstraintError(field, f"must be positive, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConstraintError(field, f"expected a duration like '8h' or '90m', got {value!r}")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", value.strip().lower())
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([a-z]+)", "", value.strip().lower()).strip():
        raise ConstraintError(field, f"cannot parse duration {value!r} (use e.g. '8h', '90m', '45s')")
    total = 0.0
    for number, unit in parts:
        if unit not in _DURATION_UNITS:
            raise ConstraintError(field, f"unknown unit {unit!r} in {value!r} (use s, m, h or d)")
        total += float(number) * _DURATION_UNITS[unit]
    if total <= 0:
        raise ConstraintError(field, f"must be positive, got {value!r}")
    return total


def parse_resource(value, field: str = "resource") -> Resources:
    """'16CPU/64GB', '2CPU', '512MB' -> Resources."""
    if not isinstance(value, str) or not value.strip():
        raise ConstraintError(field, f"expected e.g. '16CPU/64GB', got {value!r}")
    res = Resources()
    for part in value.replace(",", "/").split("/"):
        part = part.strip()
        if m := re.fullmatch(r"(\d+)\s*(?:CPUS?|CORES?)", part, re.I):
            res.cpus = int(m.group(1))
        elif m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]B?)", part, re.I):
            res.memory_bytes = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
        else:
            raise ConstraintError(field, f"cannot parse {part!r} in {value!r} (use e.g. '16CPU/64GB')")
    if res.cpus == 0 or res.memory_bytes == 0:
        raise ConstraintError(field, f"limits must be positive, got {value!r}")
    return res


def parse_deliverables(value, field: str = "deliverables") -> list[Deliverable]:
    if not isinstance(value, list):
        raise ConstraintError(field, f"expected a list, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item.strip():
            out.append(Deliverable(path=item.strip()))
        elif isinstance(item, dict) and len(item) == 1 and set(item) <= {"path", "run", "command"} \
                and isinstance(next(iter(item.values())), str) and next(iter(item.values())).strip():
            key, text = next(iter(item.items()))
            # "command" is the older spelling of "run"
            out.append(Deliverable(path=text.strip()) if key == "path" else Deliverable(command=text))
        else:
            raise ConstraintError(f"{field}[{i}]", "expected a path string, {'path': PATH} (must exist) or "
                                                   f"{{'run': COMMAND}} (must exit 0), got {item!r}")
    return out


@dataclass
class Constraints:
    timeout_s: float | None = None
    resources: Resources = field(default_factory=Resources)
    deliverables: list[Deliverable] = field(default_factory=list)
    max_steps: int = 200
    command_timeout_s: float = 600.0
    max_tokens: int | None = None  # budgets enforced by openglm.agent.resilience (raisable while running)
    max_cost: float | None = None
    network: bool = False  # whether the task's commands may use the network (if the server's sandbox allows it)


_PARSERS = {
    "timeout": ("timeout_s", parse_duration),
    "resource": ("resources", parse_resource),
    "deliverables": ("deliverables", parse_deliverables),
    "max_steps": ("max_steps", lambda v, f: _positive_int(v, f)),
    "command_timeout": ("command_timeout_s", parse_duration),
    "max_tokens": ("max_tokens", lambda v, f: _positive_int(v, f)),
    "max_cost": ("max_cost", lambda v, f: _positive_number(v, f)),
    "network": ("network", lambda v, f: _boolean(v, f)),
}


def _positive_number(value, field):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConstraintError(field, f"expected a positive number, got {value!r}")
    return float(value)


def _boolean(value, field):
    if not isinstance(value, bool):
        raise ConstraintError(field, f"expected true or false, got {value!r}")
    return value


def _positive_int(value, field):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConstraintError(field, f"expected a positive integer, got {value!r}")
    return value


def parse_constraints(raw: dict | None) -> Constraints:
    """Validate the user's constraints dict; unknown keys and bad values raise ConstraintError."""
    if raw is None:
        return Constraints()
    if not isinstance(raw, dict):
        raise ConstraintError("constraints", f"expected an object, got {type(raw).__name__}")
    c = Constraints()
    for key, value in raw.items():
        if key not in _PARSERS:
            raise ConstraintError(f"constraints.{key}", f"unknown constraint (known: {', '.join(_PARSERS)})")
        attr, parse = _PARSERS[key]
        setattr(c, attr, parse(value, f"constraints.{key}"))
    return c


def new_task_id() -> str:
    return "t-" + uuid.uuid4().hex[:12]


@dataclass
class Task:
    """One long-horizon task as stored. `constraints` keeps the user's dict as given (it is what the
    record and the API show); `parsed_constraints` is its typed form, parsed once per Task."""

    id: str
    objective: str
    workspace: str
    constraints: dict = field(default_factory=dict)
    state: str = TaskState.QUEUED.value
    phase: str = ""
    progress: float = 0.0
    reason: str = ""  # why it paused / failed / needs input
    control: str = ""  # pending request for the worker: "pause" | "cancel" | ""
    worker: str = ""  # lease owner
    lease_until: float = 0.0
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    active_s: float = 0.0  # running time accumulated over all runs (for the timeout)
    step: int = 0  # last committed step
    snapshot: str = ""  # last committed snapshot id
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    resources: dict = field(default_factory=dict)  # last resource reading
    meta: dict = field(default_factory=dict)  # free-form (policy, model name, ...)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})

    @cached_property
    def parsed_constraints(self) -> Constraints:
        return parse_constraints(self.constraints)

    @property
    def terminal(self) -> bool:
        return TaskState(self.state) in TERMINAL
