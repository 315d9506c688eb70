"""Typed configuration of the resilience layer; the defaults are the design's numbers.

CPU > 85% -> reduce batch size; memory growth > 10 MB/min (or > 2 MB/h over
long windows) -> restart the container; GPU ECC errors > 5 -> CPU mode; disk < 5 GB -> warn;
ping > 3 s -> outage. Errors escalate: retry 3x -> 2 alternatives -> snapshot rollback -> re-plan ->
ask a human. Tests build compressed variants of these configs (short windows, fast sampling).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from openglm.util.strict import check_keys

MB = 1024 * 1024


class Action(str, Enum):
    """What the runtime does when a reading crosses a threshold."""

    WARN = "warn"
    REDUCE_PARALLELISM = "reduce_parallelism"  # lower the task's parallelism / model batch
    RESTART_TREE = "restart_tree"  # kill the sandboxed process tree, resume from the last snapshot
    CPU_MODE = "cpu_mode"  # stop using the GPU
    SWITCH_FALLBACK = "switch_fallback"  # the model endpoint is out: use the fallback model
    PAUSE = "pause"  # safe pause with the reason


@dataclass
class Threshold:
    limit: float
    action: Action
    sustain: int = 1  # consecutive crossing samples before acting (one busy sample is not overload)
    cooldown_s: float = 60.0  # minimum time between two actions for the same metric


def _default_thresholds() -> dict[str, Threshold]:
    return {
        # percent of the task's CPU allotment (its resource constraint, else the machine's cores)
        "cpu_percent": Threshold(85.0, Action.REDUCE_PARALLELISM, sustain=3),
        # robust growth rates of the tree's RSS (bytes/s); see leak.py (LeakDetector). The short rule must hold for
        # 12 samples (1 minute at 5 s): a big allocation held for a while looks like growth until freed.
        "rss_growth_short": Threshold(10 * MB / 60.0, Action.RESTART_TREE, sustain=12),
        "rss_growth_long": Threshold(2 * MB / 3600.0, Action.RESTART_TREE, sustain=12),
        "gpu_ecc_errors": Threshold(5, Action.CPU_MODE),
        "disk_free_bytes": Threshold(5 * 1024**3, Action.WARN),  # crossing = falling below
        "endpoint_latency_s": Threshold(3.0, Action.SWITCH_FALLBACK, sustain=2),
    }


# Metrics whose threshold is a floor (crossing means dropping below it).
FLOOR_METRICS = frozenset({"disk_free_bytes"})


@dataclass
class MonitorConfig:
    interval_s: float = 5.0
    short_window_s: float = 300.0  # the 10 MB/min rule looks at the last 5 minutes
    long_window_s: float = 3600.0  # the 2 MB/h rule looks at the last hour
    min_window_fraction: float = 0.5  # a rule fires only once its window is this full (in time)
    trend_min: float = 0.6  # Kendall tau the samples must reach too: a leak grows steadily
    max_samples: int = 240  # per window, older ones are thinned (Theil-Sen is O(n^2))
    cpu_allotment: float | None = None  # cores the task may use; None -> all cores of the machine
    endpoint_url: str | None = None  # model endpoint probed with GET (e.g. base_url + "/models")
    endpoint_timeout_s: float = 3.0
    # given thresholds override the defaults metric by metric; None switches a metric's action off
    thresholds: dict[str, Threshold | None] = field(default_factory=_default_thresholds)

    def __post_init__(self):
        defaults = _default_thresholds()
        unknown = set(self.thresholds) - set(defaults)
        if unknown:
            raise ValueError(f"MonitorConfig.thresholds: unknown metric(s) {sorted(unknown)} "
                             f"(known: {sorted(defaults)})")
        self.thresholds = {**defaults, **self.thresholds}

    def limit(self, metric: str) -> float:
        th = self.thresholds.get(metric)
        return float("inf") if th is None else th.limit


class Level(int, Enum):
    RETRY = 1
    ALTERNATIVE = 2
    ROLLBACK = 3
    REPLAN = 4
    HUMAN = 5


@dataclass
class LadderPolicy:
    """How one error class escalates: the levels it may use, in order, and their limits."""

    levels: tuple[Level, ...] = (Level.RETRY, Level.ALTERNATIVE, Level.ROLLBACK, Level.REPLAN, Level.HUMAN)
    retries: int = 3
    backoff_s: float = 1.0  # L1 waits backoff_s * 2**attempt (capped)
    backoff_max_s: float = 60.0
    alternatives: int = 2
    rollbacks: int = 1
    replans: int = 1


def _default_policies() -> dict[str, LadderPolicy]:
    every = LadderPolicy()
    return {
        # model timeouts / 5xx / 429 and flaky commands: the full ladder from a plain retry
        "transient": every,
        "model_down": every,
        # a non-zero exit that is not flaky: a retry would do the same, try another form of it
        "command_failed": LadderPolicy(levels=(Level.ALTERNATIVE, Level.ROLLBACK, Level.REPLAN, Level.HUMAN)),
        # the verification command broke: go back to the last green snapshot first
        "verification_failed": LadderPolicy(levels=(Level.ROLLBACK, Level.REPLAN, Level.HUMAN)),
        # the agent loops: a different plan, then a human
        "stuck": LadderPolicy(levels=(Level.REPLAN, Level.HUMAN)),
        "context_limit": LadderPolicy(levels=(Level.ALTERNATIVE, Level.REPLAN, Level.HUMAN), alternatives=1),
        "resource": LadderPolicy(levels=(Level.ROLLBACK, Level.REPLAN, Level.HUMAN)),
    }


@dataclass
class LadderConfig:
    policies: dict[str, LadderPolicy] = field(default_factory=_default_policies)

    def policy(self, error_class: str) -> LadderPolicy:
        if error_class not in self.policies:
            raise KeyError(f"LadderConfig: no policy for error class {error_class!r} (have {sorted(self.policies)})")
        return self.policies[error_class]


@dataclass
class StuckConfig:
    repeat_pairs: int = 3  # identical (action, observation) this many times in a row
    repeat_errors: int = 3  # identical error this many times in a row
    cycle_repeats: int = 3  # an alternating cycle (period 2..max_period) repeated this many times
    max_period: int = 3
    no_change_steps: int = 30  # steps without any workspace change
    context_limit_errors: int = 2  # consecutive context-limit errors


@dataclass
class BudgetConfig:
    wall_clock_s: float | None = None  # the task's timeout
    max_tokens: int | None = None
    max_cost: float | None = None  # in the currency of the price table (USD)


@dataclass
class GuardConfig:
    """How the resilience layer drives a task's steps (see guard.py)."""

    verify_command: str | None = None  # run after each step that changed the workspace; green = exit 0
    verify_timeout_s: float = 600.0
    failure_streak: int = 2  # consecutive failing steps = a failing approach (one failure is normal work)
    parallelism: int = 4  # the task's parallelism / model batch knob, halved on CPU overload
    price_per_mtok: tuple[float, float] = (0.0, 0.0)  # USD per million (prompt, completion) tokens
    tool_retry: bool = True  # L1 for hung (timed-out) commands


@dataclass
class ResilienceConfig:
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    stuck: StuckConfig = field(default_factory=StuckConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    monitor_enabled: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict | None) -> "ResilienceConfig":
        """From JSON-like data (e.g. AgentConfig.resilience); unknown keys are errors naming the key."""
        raw = dict(raw or {})
        check_keys(raw, cls, "key(s) of resilience")
        mon = dict(raw.get("monitor", {}))
        check_keys(mon, MonitorConfig, "key(s) of resilience.monitor")
        if "thresholds" in mon:
            mon["thresholds"] = {k: None if v is None else Threshold(v["limit"], Action(v["action"]),
                                                                      v.get("sustain", 1), v.get("cooldown_s", 60.0))
                                 for k, v in mon["thresholds"].items()}
        policies = {k: LadderPolicy(**{**v, "levels": tuple(Level(x) for x in v.get("levels", LadderPolicy().levels))})
                    for k, v in raw.get("ladder", {}).get("policies", {}).items()}
        guard = dict(raw.get("guard", {}))
        check_keys(guard, GuardConfig, "key(s) of resilience.guard")
        if "price_per_mtok" in guard:
            guard["price_per_mtok"] = tuple(guard["price_per_mtok"])
        stuck = raw.get("stuck", {})
        check_keys(stuck, StuckConfig, "key(s) of resilience.stuck")
        return cls(monitor=MonitorConfig(**mon),
                   ladder=LadderConfig(policies={**_default_policies(), **policies}),
                   stuck=StuckConfig(**stuck), guard=GuardConfig(**guard),
                   monitor_enabled=raw.get("monitor_enabled", True))

