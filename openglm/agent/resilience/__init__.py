"""Resilience for long agent tasks: resource monitor, recovery ladder, stuck detection, budgets.

    from openglm.agent.resilience import ResilienceConfig, ResourceMonitor, RecoveryLadder

One module per concept: `config` (typed settings); what the monitor reads and does: `process_tree`,
`probes`, `leak` (leak estimate), `monitor`; recovery: `ladder` (failures, the five-level ladder, the
one retry loop), `plan` (the goal tree L4 rebuilds); inside a run: `guard` (after each step), `stuck`
(stuck detection), `budget`; the plug-in: `calls` (the model and tool wrappers), `hooks` (the runtime's
hooks), `metrics` (Prometheus) and `routes` (the budget route).
"""

from .budget import BudgetExceeded, BudgetTracker, raise_budget
from .config import (
                     Action,
                     BudgetConfig,
                     LadderConfig,
                     LadderPolicy,
                     Level,
                     MonitorConfig,
                     ResilienceConfig,
                     StuckConfig,
                     Threshold,
)
from .hooks import ResilienceHooks
from .ladder import ClassifiedError, Decision, Escalation, Failure, RecoveryLadder, classify, retry_call
from .leak import LeakDetector, theil_sen
from .metrics import ResilienceMetrics
from .monitor import Alert, ResourceMonitor
from .plan import GoalTree, parse_plan
from .stuck import StepDigest, StuckDetector, StuckSignal, condense_loop

__all__ = [
    "Action", "Alert", "BudgetConfig", "BudgetExceeded", "BudgetTracker", "ClassifiedError", "Decision",
    "Escalation", "Failure", "GoalTree", "LadderConfig", "LadderPolicy", "LeakDetector", "Level",
    "MonitorConfig", "RecoveryLadder", "ResilienceConfig", "ResilienceHooks", "ResilienceMetrics",
    "ResourceMonitor", "StepDigest", "StuckConfig", "StuckDetector", "StuckSignal", "Threshold", "classify",
    "condense_loop", "parse_plan", "raise_budget", "retry_call", "theil_sen",
]
