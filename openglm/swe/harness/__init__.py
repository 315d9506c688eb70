"""SWE-bench-format evaluation harness without Docker (see docs/swe.md)."""

from openglm.swe.harness.run import HarnessConfig, run_evaluation

__all__ = ["HarnessConfig", "run_evaluation"]
