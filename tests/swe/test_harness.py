"""The SWE-bench-format harness on three hand-written instances: gold resolves all, empty none,
a corrupt patch is unresolved (not a crash), an unparsable log is an infrastructure error,
a rerun resumes, and the reports have SWE-bench's layout."""

from __future__ import annotations

import json

from openglm.swe.harness import HarnessConfig, run_evaluation
from openglm.swe.harness.instances import load_instances, load_predictions


def _config(tmp_path, repos, run_id):
    return HarnessConfig(run_id=run_id, out_dir=tmp_path / "out", repos_dir=repos, workers=2, timeout=120)


def test_gold_resolves_all_and_empty_none(tmp_path, hand_instances):
    repos, instances = hand_instances
    gold = run_evaluation(instances, load_predictions("gold", instances), _config(tmp_path, repos, "g"))
    assert gold["resolved_instances"] == 3 and gold["error_instances"] == 0
    empty = run_evaluation(instances, load_predictions("empty", instances), _config(tmp_path, repos, "e"))
    assert empty["resolved_instances"] == 0 and empty["completed_instances"] == 3
    assert sorted(empty["empty_patch_ids"]) == sorted(i["instance_id"] for i in instances)
    # the per-instance report says why: FAIL_TO_PASS failed, PASS_TO_PASS still passed
    iid = instances[2]["instance_id"]
    rep = json.loads((tmp_path / "out/logs/run_evaluation/e/empty" / iid / "report.json").read_text())[iid]
    assert rep["tests_status"]["FAIL_TO_PASS"]["failure"] == instances[2]["FAIL_TO_PASS"]
    assert rep["tests_status"]["PASS_TO_PASS"]["success"] == instances[2]["PASS_TO_PASS"]
    run_report = json.loads((tmp_path / "out" / "gold.g.json").read_text())
    assert run_report["schema_version"] == 2 and len(run_report["resolved_ids"]) == 3


def test_corrupt_patch_is_unresolved_and_bad_log_is_an_error(tmp_path, hand_instances):
    repos, instances = hand_instances
    calc = instances[0]
    corrupt = calc["patch"].replace("-    return price * rate", "-    return price ** rate")
    bad_log = dict(instances[1], instance_id="unparsable", test_cmd="echo no test results here")
    preds = {calc["instance_id"]: {"instance_id": calc["instance_id"], "model_name_or_path": "m",
                                   "model_patch": corrupt},
             "unparsable": {"instance_id": "unparsable", "model_name_or_path": "m",
                            "model_patch": instances[1]["patch"]}}
    report = run_evaluation([calc, bad_log], preds, _config(tmp_path, repos, "c"))
    assert report["unresolved_ids"] == [calc["instance_id"]]
    assert report["error_ids"] == ["unparsable"]
    log_dir = tmp_path / "out/logs/run_evaluation/c/m"
    rep = json.loads((log_dir / calc["instance_id"] / "report.json").read_text())[calc["instance_id"]]
    assert rep["patch_successfully_applied"] is False and rep["resolved"] is False
    assert "Patch Apply Failed" in (log_dir / calc["instance_id"] / "run_instance.log").read_text()


def test_rerun_skips_finished_instances(tmp_path, hand_instances):
    repos, instances = hand_instances
    preds = load_predictions("gold", instances[:1])
    config = _config(tmp_path, repos, "r")
    run_evaluation(instances[:1], preds, config)
    log = tmp_path / "out/logs/run_evaluation/r/gold" / instances[0]["instance_id"] / "run_instance.log"
    first = log.stat().st_mtime_ns
    again = run_evaluation(instances[:1], preds, config)
    assert again["resolved_instances"] == 1 and log.stat().st_mtime_ns == first


def test_instances_and_predictions_files(tmp_path, hand_instances):
    _, instances = hand_instances
    # SWE-bench ships the test lists as JSON strings; JSONL and JSON both load
    as_swebench = [dict(i, FAIL_TO_PASS=json.dumps(i["FAIL_TO_PASS"])) for i in instances]
    (tmp_path / "i.json").write_text(json.dumps(as_swebench))
    (tmp_path / "i.jsonl").write_text("".join(json.dumps(i) + "\n" for i in instances))
    assert load_instances(tmp_path / "i.json") == load_instances(tmp_path / "i.jsonl")
    (tmp_path / "p.jsonl").write_text(json.dumps({"instance_id": "x", "model_patch": ""}) + "\n")
    assert load_predictions(str(tmp_path / "p.jsonl"), [])["x"]["model_name_or_path"] == "p"
    (tmp_path / "bad.json").write_text(json.dumps([{"instance_id": "x"}]))
    try:
        load_instances(tmp_path / "bad.json")
    except ValueError as e:
        assert "lacks" in str(e) and "base_commit" in str(e)
    else:
        raise AssertionError("an instance without its fields must be refused")
