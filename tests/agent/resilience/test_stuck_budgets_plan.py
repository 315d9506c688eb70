"""Stuck detection, context condensation, budgets and the goal tree."""

import pytest

from openglm.agent.resilience import (
    BudgetConfig,
    BudgetTracker,
    GoalTree,
    StepDigest,
    StuckConfig,
    StuckDetector,
    condense_loop,
    parse_plan,
)


def _feed(det, steps):
    signals = []
    for i, (action, obs, *rest) in enumerate(steps):
        err = rest[0] if rest else None
        changed = rest[1] if len(rest) > 1 else False
        sig = det.observe(StepDigest(i, action, obs, err, changed))
        if sig:
            signals.append(sig)
    return signals


def test_repeated_action_observation_pairs_ignore_numbers():
    det = StuckDetector(StuckConfig(no_change_steps=100))
    sig = _feed(det, [("ls", "a b", None, True), ("cat x", "took 1.2s"), ("cat x", "took 1.3s"), ("cat x", "took 9s")])
    assert len(sig) == 1 and sig[0].kind == "repeated_pair" and sig[0].steps == [1, 2, 3]
    assert sig[0].error_class == "stuck"


def test_repeated_errors_cycles_no_progress_and_context_limit():
    det = StuckDetector(StuckConfig(no_change_steps=100))
    errs = [(f"try {i}", f"out {c}", "ImportError: no module named foo") for i, c in enumerate("abc")]
    assert [s.kind for s in _feed(det, errs)] == ["repeated_error"]
    det = StuckDetector(StuckConfig(no_change_steps=100))
    cycle = [("open a", "A"), ("open b", "B")] * 3
    sig = _feed(det, cycle)
    assert [s.kind for s in sig] == ["cycle"] and sig[0].steps == list(range(6))
    det = StuckDetector(StuckConfig(no_change_steps=5))
    sig = _feed(det, [(f"read {i}", f"content {c}") for i, c in enumerate("abcdef")])
    assert [s.kind for s in sig] == ["no_progress"] and len(sig[0].steps) == 5
    det = StuckDetector(StuckConfig(context_limit_errors=2))
    det.observe(StepDigest(0, "x", context_limit=True))
    sig = det.observe(StepDigest(1, "y", context_limit=True))
    assert sig.kind == "context_limit" and sig.error_class == "context_limit"


def test_progress_is_not_stuck():
    det = StuckDetector(StuckConfig(no_change_steps=5))
    steps = [(f"edit f{i}", f"ok {'abcdefghij'[i]}", None, True) for i in range(10)]
    assert _feed(det, steps) == []


def test_condense_loop_keeps_the_first_attempt_and_one_summary():
    turns = [{"step": i, "content": f"turn {i}"} for i in range(6)]
    out = condense_loop(turns, [2, 3, 4], lambda t: t["step"], {"step": None, "content": "loop removed"})
    assert [t["content"] for t in out] == ["turn 0", "turn 1", "turn 2", "loop removed", "turn 5"]


def test_budgets_tokens_wall_clock_pause_and_raise():
    now = [0.0]
    b = BudgetTracker(BudgetConfig(wall_clock_s=10, max_tokens=100, max_cost=1.0), prices={"m": (1e6, 0)},
                      clock=lambda: now[0])
    b.start()
    b.charge(40, 10)
    assert b.exceeded() is None
    b.charge(30, 20)
    over = b.exceeded()
    assert over.kind == "tokens" and over.used == 100
    b.raise_caps(max_tokens=1000)
    assert b.exceeded() is None
    now[0] = 5.0
    b.stop()  # paused: time does not count
    now[0] = 500.0
    assert b.elapsed == 5.0 and b.exceeded() is None
    restored = BudgetTracker(prices={"m": (1e6, 0)}, clock=lambda: now[0]).load(b.state())
    restored.start()
    now[0] = 505.0
    assert restored.exceeded().kind == "wall_clock" and restored.tokens == 100
    restored.charge(1, 0, model="m")  # 1 token at 1 USD/token
    with pytest.raises(ValueError, match="max_tokens"):
        restored.raise_caps(max_tokens=5)
    restored.raise_caps(wall_clock_s=60)
    assert restored.exceeded().kind == "cost"


def test_goal_tree_replan_keeps_the_failure_as_context():
    plan = GoalTree("fix the bug")
    plan.add("g0", "patch parser")
    plan.add("g0", "run tests")
    assert plan.current().text == "patch parser"
    plan.replan("parser patch broke 3 tests", parse_plan("New plan:\n1. revert parser\n2) patch lexer\n- run tests"))
    texts = {g.text: g.status for g in plan.walk()}
    assert texts["patch parser"] == "failed" and texts["run tests"] in ("dropped", "open")
    assert plan.current().text == "revert parser" and plan.revision == 1
    assert "parser patch broke 3 tests" in plan.render()
    again = GoalTree.from_dict(plan.to_dict())
    assert again.render() == plan.render() and again.revision == 1
