"""Resilience for long agent tasks: resource monitor, recovery ladder, stuck detection, budgets.

    from openglm.agent.resilience import ResilienceConfig, ResourceMonitor, RecoveryLadder
"""

from .budgets import BudgetExceeded, BudgetTracker
from .config import (Action, BudgetConfig, LadderConfig, LadderPolicy, Level, MonitorConfig, ResilienceConfig,
                     StuckConfig, Threshold)
from .errors import ClassifiedError, Failure, classify
from .ladder import Decision, RecoveryLadder
from .leak import LeakDetector, theil_sen
from .metrics import ResilienceMetrics
from .monitor import Alert, ResourceMonitor
from .plan import GoalTree, parse_plan
from .recovery import Escalation, call_with_recovery
from .stuck import StepRecord, StuckDetector, StuckSignal, condense_loop

__all__ = [
    "Action", "Alert", "BudgetConfig", "BudgetExceeded", "BudgetTracker", "ClassifiedError", "Decision",
    "Escalation", "Failure", "GoalTree", "LadderConfig", "LadderPolicy", "LeakDetector", "Level",
    "MonitorConfig", "RecoveryLadder", "ResilienceConfig", "ResilienceMetrics", "ResourceMonitor",
    "StepRecord", "StuckConfig", "StuckDetector", "StuckSignal", "Threshold", "call_with_recovery",
    "classify", "condense_loop", "parse_plan", "theil_sen",
]
