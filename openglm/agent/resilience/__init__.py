"""Resilience for long agent tasks: resource monitor, recovery ladder, stuck detection, budgets.

    from openglm.agent.resilience import ResilienceConfig, ResourceMonitor, RecoveryLadder

One module per concern: `config` (typed settings), `ladder` (failures, the five-level recovery
ladder, the plan), `monitor` (probes, leak detection, actuators, the resource monitor), `guard`
(stuck detection, budgets, the per-step guard), `hooks` (the plug-in into the runtime's hooks:
model/tool wrappers, monitor, budgets, routes and metrics).
"""

from .config import (Action, BudgetConfig, LadderConfig, LadderPolicy, Level, MonitorConfig, ResilienceConfig,
                     StuckConfig, Threshold)
from .guard import BudgetExceeded, BudgetTracker, StepDigest, StuckDetector, StuckSignal, condense_loop
from .hooks import ResilienceMetrics
from .ladder import (ClassifiedError, Decision, Escalation, Failure, GoalTree, RecoveryLadder, call_with_recovery,
                     classify, parse_plan)
from .monitor import Alert, LeakDetector, ResourceMonitor, theil_sen

__all__ = [
    "Action", "Alert", "BudgetConfig", "BudgetExceeded", "BudgetTracker", "ClassifiedError", "Decision",
    "Escalation", "Failure", "GoalTree", "LadderConfig", "LadderPolicy", "LeakDetector", "Level",
    "MonitorConfig", "RecoveryLadder", "ResilienceConfig", "ResilienceMetrics", "ResourceMonitor",
    "StepDigest", "StuckConfig", "StuckDetector", "StuckSignal", "Threshold", "call_with_recovery",
    "classify", "condense_loop", "parse_plan", "theil_sen",
]
