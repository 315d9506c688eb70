"""swe-solve -> swe-eval: the four-phase policy (replay model) fixes a hand-written instance; its
prediction (workspace diff, agent-written tests left out) resolves the instance in the harness."""

from __future__ import annotations

import json

from openglm.agent.llm import ModelSpec
from openglm.swe.harness import HarnessConfig, run_evaluation
from openglm.swe.harness.instances import load_predictions
from openglm.swe.solve import SolveConfig, solve


def call(name, **arguments):
    return {"content": "", "tool_calls": [{"name": name, "arguments": arguments}]}


def test_solve_then_evaluate(tmp_path, hand_instances):
    repos, instances = hand_instances
    calc = instances[0]
    regression = "from calc import add_tax\n\ndef test_tax():\n    assert add_tax(10, 0.2) == 12\n"
    turns = [
        call("phase_done", summary="flat module, pytest"),
        call("phase_done", summary="add_tax multiplies by the rate only"),
        call("regression_test", path="tests/test_tax_regression.py", content=regression,
             test="tests/test_tax_regression.py::test_tax"),
        call("propose_candidates", candidates=[{"summary": "add the rate", "patch": calc["patch"]}]),
        call("run_suite"),
        call("submit", summary="add_tax adds the tax"),
    ]
    script = tmp_path / "turns.jsonl"
    script.write_text("".join(json.dumps(t) + "\n" for t in turns))
    config = SolveConfig(out_dir=tmp_path / "solve", repos_dir=repos, model=ModelSpec(replay=str(script)),
                         model_name="replay")
    path = solve([calc], config)
    (pred,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert pred["openglm_state"] == "SUCCEEDED", pred["openglm_reason"]
    assert "b/calc.py" in pred["model_patch"] and "test_tax_regression" not in pred["model_patch"]
    assert solve([calc], config) == path and len(path.read_text().splitlines()) == 1  # resumable
    report = run_evaluation([calc], load_predictions(str(path), [calc]),
                            HarnessConfig(run_id="solve", out_dir=tmp_path / "eval", repos_dir=repos))
    assert report["resolved_ids"] == [calc["instance_id"]]


def test_a_rerun_of_swe_solve_retries_paused_instances(tmp_path):
    from openglm.swe.solve import finished_ids

    preds = tmp_path / "predictions.jsonl"
    rows = [{"instance_id": "a", "model_patch": "", "openglm_state": "PAUSED"},
            {"instance_id": "b", "model_patch": "x", "openglm_state": "SUCCEEDED"},
            {"instance_id": "c", "model_patch": "", "openglm_state": "PAUSED"},
            {"instance_id": "c", "model_patch": "y", "openglm_state": "FAILED"}]  # rerun: the last line wins
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert finished_ids(preds) == {"b", "c"} and finished_ids(tmp_path / "none.jsonl") == set()


def test_solve_a_real_shaped_instance_through_the_harness(tmp_path, bugsinpy_fixture):
    """An instance built by the real-bug builder (its own environment, a history of bugs and fixes):
    the scripted policy's checks run the repository's tests under the instance's venv, and the
    prediction is graded by the harness."""
    import os

    from openglm.swe.gen.bugsinpy import BugsInPyConfig, build
    from openglm.swe.harness.instances import load_instances

    bugsinpy, repos = bugsinpy_fixture
    (inst,) = load_instances(build(BugsInPyConfig(bugsinpy_dir=bugsinpy, repos_dir=repos, out_dir=tmp_path / "b",
                                                  bugs=("minishop-1",), timeout=120)))
    regression = "from minishop.prices import bulk_price\n\n\ndef test_tier():\n    assert bulk_price(1, 10) == 9\n"
    turns = [
        call("phase_done", summary="a package and tests; pytest"),
        call("phase_done", summary="bulk_price's tier starts above 10", failing_tests=[]),
        call("regression_test", path="tests/test_tier_regression.py", content=regression,
             test="tests/test_tier_regression.py::test_tier"),
        call("propose_candidates", candidates=[{"summary": "the tier starts at 10", "patch": inst["patch"]}]),
        call("run_suite"),
        call("submit", summary="bulk_price gives the tier discount from 10 items"),
    ]
    script = tmp_path / "turns.jsonl"
    script.write_text("".join(json.dumps(t) + "\n" for t in turns))
    before = os.environ.get("OPENGLM_TEST_PYTHON")
    config = SolveConfig(out_dir=tmp_path / "solve", repos_dir=repos, model=ModelSpec(replay=str(script)),
                         model_name="replay", envs_dir=tmp_path / "b" / "envs")
    (pred,) = [json.loads(x) for x in solve([inst], config).read_text().splitlines()]
    assert pred["openglm_state"] == "SUCCEEDED", pred["openglm_reason"]
    assert (tmp_path / "solve" / inst["instance_id"] / "venv" / "bin" / "python").exists()
    assert os.environ.get("OPENGLM_TEST_PYTHON") == before
    report = run_evaluation([inst], {inst["instance_id"]: pred},
                            HarnessConfig(run_id="real", out_dir=tmp_path / "eval", repos_dir=repos))
    assert report["resolved_ids"] == [inst["instance_id"]]
