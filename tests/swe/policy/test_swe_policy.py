"""End-to-end: the four-phase SWE policy on the real runtime (store, snapshots, shell) with a replay
model. Three candidates, one right -> it is chosen for the right reasons (scores logged), after a
regression test shown failing, verified, SUCCEEDED. Three wrong -> the recovery ladder escalates
L3 rollback -> L4 re-plan -> L5 human (NEEDS_INPUT) instead of looping."""

from __future__ import annotations

import sys
import textwrap

import pytest

from openglm.agent import service
from openglm.agent.llm import ReplayModel
from openglm.agent.store.sqlite_store import SQLiteStore
from openglm.agent.worker import Worker
from openglm.swe.policy import SWEPolicy, SWEPolicyConfig
from openglm.util.git import init_repo, unified_diff

UNITS = "def to_cents(price):\n    return round(price * 100)\n"
PRICES = textwrap.dedent("""
    from shop.units import to_cents

    def total(items):
        return sum(to_cents(p) * q for p, q in items)

    def apply_discount(cents, percent):
        off = cents * percent // 100
        return cents + off
    """).lstrip()
TESTS = textwrap.dedent("""
    from shop.prices import apply_discount, total

    def test_total():
        assert total([(1.5, 2)]) == 300

    def test_discount():
        assert apply_discount(1000, 10) == 900
    """).lstrip()
REGRESSION = "from shop.prices import apply_discount\n\ndef test_discount_is_subtracted():\n" \
             "    assert apply_discount(200, 50) == 100\n"
FAILING = "tests/test_prices.py::test_discount"
REG_ID = "tests/test_regression.py::test_discount_is_subtracted"


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def turn(*calls, content=""):
    return {"content": content, "tool_calls": list(calls)}


def patch(rel, before, after):
    return unified_diff(rel, before, after)


RIGHT = patch("shop/prices.py", PRICES, PRICES.replace("cents + off", "cents - off"))
NO_FIX = patch("shop/prices.py", PRICES, PRICES.replace("percent // 100", "percent // 10"))
BROAD = (patch("shop/prices.py", PRICES, PRICES.replace(
    "    off = cents * percent // 100\n    return cents + off",
    "    return cents - to_cents(cents * percent / 10000)"))
    + patch("shop/units.py", UNITS, UNITS + "\n\ndef from_cents(cents):\n    return cents / 100\n"))
BREAKS_TOTAL = patch("shop/prices.py", PRICES, PRICES.replace("cents + off", "cents - off").replace(
    "to_cents(p) * q", "to_cents(p)"))
NEGATES = patch("shop/prices.py", PRICES, PRICES.replace("cents + off", "off - cents"))
IGNORES_BUG = patch("shop/prices.py", PRICES, PRICES.replace("def total(items):", "def total(items):  # ok"))


def opening_turns():
    py = sys.executable
    return [
        turn(call("bash", command="ls -R shop tests"), call("phase_done", summary="pytest project, package shop")),
        turn(call("bash", command=f"{py} -m pytest -q {FAILING} 2>&1 | tail -3"),
             call("localize", failing_tests=[FAILING])),
        turn(call("phase_done", summary="apply_discount adds the discount", failing_tests=[FAILING])),
        turn(call("regression_test", path="tests/test_regression.py", content=REGRESSION, test=REG_ID)),
    ]


@pytest.fixture
def shop(tmp_path):
    ws = tmp_path / "ws"
    for rel, text in {"shop/__init__.py": "", "shop/units.py": UNITS, "shop/prices.py": PRICES,
                      "tests/test_prices.py": TESTS}.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    init_repo(ws)
    return ws


def run_task(tmp_path, ws, turns, policy_config):
    from openglm.agent.config import AgentConfig

    config = AgentConfig(data_dir=str(tmp_path / "data"), lease_ttl=30, poll_interval=0.05)
    store = SQLiteStore(str(tmp_path / "agent.db"))
    task = service.submit(store, config, "tests/test_prices.py::test_discount fails: the discount is added",
                          str(ws), {"timeout": "10m", "max_steps": 30})
    worker = Worker(config, store=store, model=ReplayModel(turns),
                    policy_factory=lambda: SWEPolicy(policy_config))
    final = worker.run_one()
    return final, store, task


def events_of(store, task, kind):
    return [e for e in store.all_events(task.id) if e.kind == kind]


def test_picks_the_right_candidate_after_a_failing_regression_test(tmp_path, shop):
    turns = opening_turns() + [
        turn(call("propose_candidates", candidates=[
            {"summary": "subtract, simplify total", "patch": BREAKS_TOTAL},
            {"summary": "recompute through to_cents, add from_cents", "patch": BROAD},
            {"summary": "subtract the discount", "patch": RIGHT}])),
        turn(call("run_suite")),
        turn(call("submit", summary="apply_discount subtracts the discount")),
    ]
    final, store, task = run_task(tmp_path, shop, turns, SWEPolicyConfig())
    assert final == "SUCCEEDED", store.get_task(task.id).reason
    moves = [(e.data["from"], e.data["to"]) for e in events_of(store, task, "phase_transition")]
    assert moves == [("environment", "diagnosis"), ("diagnosis", "design"), ("design", "verification")]
    (reg,) = events_of(store, task, "regression_test")
    assert reg.data["failed_before_fix"] is True
    (scores,) = events_of(store, task, "candidate_scores")
    assert reg.step < scores.step  # the test came first
    s = scores.data["scores"]
    assert scores.data["chosen"] == 2
    assert s[0]["tests_pass"] is True and s[0]["passes"] is False and s[0]["why"] == "suite fails"
    assert s[1]["passes"] is True and s[2]["passes"] is True
    assert s[1]["impact"] > s[2]["impact"]  # both pass: the less destructive one wins
    assert "cents - off" in (shop / "shop/prices.py").read_text()
    assert (shop / "shop/units.py").read_text() == UNITS and (shop / "tests/test_regression.py").exists()
    obs = [e.data["output"] for e in events_of(store, task, "observation")]
    assert any("FAILS before the fix" in o for o in obs) and any("full suite: 3 passed, 0 failed" in o for o in obs)
    assert store.get_task(task.id).phase == "succeeded"


def test_three_wrong_candidates_escalate_instead_of_looping(tmp_path, shop):
    wrong = turn(call("propose_candidates", candidates=[
        {"summary": "scale", "patch": NO_FIX}, {"summary": "negate", "patch": NEGATES},
        {"summary": "comment", "patch": IGNORES_BUG}]))
    turns = opening_turns() + [
        wrong,  # served twice: after the L3 rollback the conversation is back at this point
        turn(call("phase_done", summary="re-planned: still apply_discount", failing_tests=[FAILING])),
        wrong,
        turn(content="Every candidate fails the regression test; which behaviour is intended?"),
    ]
    final, store, task = run_task(tmp_path, shop, turns, SWEPolicyConfig(run_suite_when_scoring=False))
    t = store.get_task(task.id)
    assert final == "NEEDS_INPUT" and "which behaviour is intended" in t.reason
    levels = [e.data["level"] for e in events_of(store, task, "recovery_escalation")]
    assert levels == [3, 4, 5]
    assert [e.data["to_step"] for e in events_of(store, task, "rollback")] == [4]
    rounds = events_of(store, task, "candidate_scores")
    assert [e.data["chosen"] for e in rounds] == [None, None, None]
    assert all(s["why"] == "target tests fail" for e in rounds for s in e.data["scores"])
    assert t.model_calls == 9  # bounded: no loop
    assert "cents + off" in (shop / "shop/prices.py").read_text()  # nothing wrong was applied
