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
