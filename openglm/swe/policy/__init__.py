"""The four-phase software-engineering policy for the agent runtime (see docs/swe.md).

Use it with `AgentConfig(policy="openglm.swe.policy:factory")`, or build one in Python with
`SWEPolicy(SWEPolicyConfig(...))` and pass `policy_factory=lambda: policy` to a Worker.
"""

from openglm.swe.policy.config import PHASES, PhaseBudget, SWEPolicyConfig
from openglm.swe.policy.policy import SWEPolicy

__all__ = ["PHASES", "PhaseBudget", "SWEPolicy", "SWEPolicyConfig", "factory"]


def factory(config=None) -> SWEPolicy:
    """AgentConfig.policy entry point; budgets etc. come from `AgentConfig.policy_config` (SWEPolicyConfig keys)."""
    raw = dict(config.policy_config) if config is not None else {}
    if config is not None and "context_limit" not in raw:
        raw["context_limit"] = config.context_limit
    return SWEPolicy(SWEPolicyConfig.from_dict(raw))
