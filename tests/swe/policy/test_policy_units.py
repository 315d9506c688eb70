"""The policy's gates and configuration, without running a task: what each phase lets through."""

from __future__ import annotations

import pytest

from openglm.agent.llm.base import ModelResponse, ToolCall
from openglm.swe.policy import SWEPolicy, SWEPolicyConfig
from openglm.swe.policy.policy import initial_data
from openglm.swe.policy.tools import parse_check


def acts(policy, *calls):
    return [c for c, _ in policy.actions(ModelResponse(tool_calls=[ToolCall(n, a, id=f"c{i}")
                                                                   for i, (n, a) in enumerate(calls)]))]


def test_gates_by_phase():
    policy = SWEPolicy(SWEPolicyConfig(python="/usr/bin/python3"))
    policy._pd = {**initial_data(), "phase": "design", "mapped": True}
    early = acts(policy, ("propose_candidates", {"candidates": []}), ("submit", {}), ("run_suite", {}))
    assert "regression test first" in early[0].arguments["command"]
    assert "submit refused" in early[1].arguments["command"]
    assert "not available in the design phase" in early[2].arguments["command"]
    policy._pd.update(regression={"test": "t.py::t", "path": "t.py"}, failing_tests=["a.py::f"])
    (score,) = acts(policy, ("propose_candidates", {"candidates": [{"patch": "p"}] * 5}))
    assert score.name == "bash" and "checks score" in score.arguments["command"]
    assert '"tests": ["a.py::f", "t.py::t"]' in score.arguments["command"]
    assert score.arguments["command"].count('"patch": "p"') == 3  # N = 3 candidates at most
    policy._pd.update(phase="verification", verified=True)
    (submit,) = acts(policy, ("submit", {"summary": "done"}))
    assert submit.name == "submit"
    policy._pd = None  # a step redone after a restart: phase tools are refused, plain tools pass
    redo = acts(policy, ("run_suite", {}), ("bash", {"command": "ls"}))
    assert "restart" in redo[0].arguments["command"] and redo[1].arguments == {"command": "ls"}


def test_environment_step_gets_the_repo_map_and_human_escalation_asks():
    policy = SWEPolicy(SWEPolicyConfig(python="py"))
    policy._pd = initial_data()
    first = acts(policy, ("bash", {"command": "ls"}))
    assert "checks repomap" in first[0].arguments["command"] and first[1].arguments == {"command": "ls"}
    policy._pd = {**initial_data(), "ask_human": "How to proceed?"}
    (ask,) = [c for c, _ in policy.actions(ModelResponse(content="I tried three fixes."))]
    assert ask.name == "ask_user" and ask.arguments["question"] == "How to proceed?\n\nI tried three fixes."


def test_config_and_check_parsing():
    cfg = SWEPolicyConfig.from_dict({"budgets": {"design": {"minutes": 60, "steps": 50}}, "n_candidates": 2})
    assert cfg.budgets["design"].minutes == 60 and cfg.budgets["diagnosis"].minutes == 15
    with pytest.raises(ValueError, match="budgets.designs"):
        SWEPolicyConfig.from_dict({"budgets": {"designs": {"minutes": 1, "steps": 1}}})
    with pytest.raises(ValueError, match="unknown key"):
        SWEPolicyConfig.from_dict({"candidates": 3})
    assert parse_check('[exit code 0]\nx\nOPENGLM-CHECK {"ok": true}\n') == {"ok": True}
    assert parse_check("no marker") is None
