"""Grade one instance like SWE-bench: resolved only if every FAIL_TO_PASS and PASS_TO_PASS test
passes in the log of the patched repository."""

from __future__ import annotations

from openglm.swe.logparse import test_passed


def tests_status(instance: dict, status: dict[str, str]) -> dict:
    out = {}
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        tests = instance[key]
        out[key] = {"success": [t for t in tests if test_passed(t, status)],
                    "failure": [t for t in tests if not test_passed(t, status)]}
    out["FAIL_TO_FAIL"] = {"success": [], "failure": []}
    out["PASS_TO_FAIL"] = {"success": [], "failure": []}
    return out


def instance_report(instance: dict, patch: str | None, applied: bool,
                    status: dict[str, str] | None) -> dict:
    """The per-instance report.json body, keyed by instance id as SWE-bench writes it."""
    rep = {"patch_is_None": patch is None, "patch_exists": bool(patch),
           "patch_successfully_applied": applied, "resolved": False}
    if applied and status is not None:  # an empty status (a crashed run): every graded test failed
        ts = tests_status(instance, status)
        rep["tests_status"] = ts
        rep["resolved"] = not ts["FAIL_TO_PASS"]["failure"] and not ts["PASS_TO_PASS"]["failure"]
    return {instance["instance_id"]: rep}
