"""Configuration of the four-phase SWE policy: per-phase time/step budgets, candidates, checks."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from openglm.util.strict import check_keys

PHASES = ("environment", "diagnosis", "design", "verification")


@dataclass
class PhaseBudget:
    minutes: float
    steps: int


def _default_budgets() -> dict[str, PhaseBudget]:
    # the write-ups' split of a long task: ~5 / 15 / 30 / 10 minutes
    return {"environment": PhaseBudget(5, 8), "diagnosis": PhaseBudget(15, 20),
            "design": PhaseBudget(30, 30), "verification": PhaseBudget(10, 10)}


@dataclass
class SWEPolicyConfig:
    budgets: dict[str, PhaseBudget] = field(default_factory=_default_budgets)
    n_candidates: int = 3
    run_suite_when_scoring: bool = True  # score candidates on the full suite too, not only target tests
    test_timeout: float = 600
    python: str = sys.executable  # runs the checks (openglm must be importable by it)
    context_limit: int = 100_000

    @classmethod
    def from_dict(cls, raw: dict) -> "SWEPolicyConfig":
        raw = dict(raw)
        check_keys(raw, cls, "key(s) of the swe policy config")
        budgets = _default_budgets()
        for phase, b in raw.pop("budgets", {}).items():
            if phase not in PHASES:
                raise ValueError(f"swe policy config: budgets.{phase}: unknown phase (have {PHASES})")
            budgets[phase] = PhaseBudget(**b) if isinstance(b, dict) else b
        return cls(budgets=budgets, **raw)
