"""The SWE-bench-format harness on three hand-written instances: gold resolves all, empty none,
a corrupt patch is unresolved (not a crash), a runner that crashes fails the instance with its log
kept, an environment that does not build is an error reported apart, only test modules run, a rerun
resumes, and the reports have SWE-bench's layout."""

from __future__ import annotations

import json

from openglm.swe.harness import HarnessConfig, run_evaluation
from openglm.swe.harness import run as harness_run
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


def test_corrupt_patch_crashed_runner_and_broken_environment(tmp_path, hand_instances):
    repos, instances = hand_instances
    calc = instances[0]
    corrupt = calc["patch"].replace("-    return price * rate", "-    return price ** rate")
    # a runner that reports no test (as pytest's INTERNALERROR): the instance failed, its log is kept
    crashed = dict(instances[1], instance_id="crashed", test_cmd="echo 'INTERNALERROR> boom'; exit 3")
    # an environment that does not build: an error, reported apart from what the patch did
    broken = dict(instances[2], instance_id="broken-env", openglm_env={"install_cmd": "echo no setup.py; exit 2"})
    preds = {i["instance_id"]: {"instance_id": i["instance_id"], "model_name_or_path": "m", "model_patch": p}
             for i, p in [(calc, corrupt), (crashed, instances[1]["patch"]), (broken, instances[2]["patch"])]}
    report = run_evaluation([calc, crashed, broken], preds, _config(tmp_path, repos, "c"))
    assert report["unresolved_ids"] == [calc["instance_id"], "crashed"]
    assert report["error_ids"] == report["env_error_ids"] == ["broken-env"]
    log_dir = tmp_path / "out/logs/run_evaluation/c/m"
    rep = json.loads((log_dir / calc["instance_id"] / "report.json").read_text())[calc["instance_id"]]
    assert rep["patch_successfully_applied"] is False and rep["resolved"] is False
    assert "Patch Apply Failed" in (log_dir / calc["instance_id"] / "run_instance.log").read_text()
    rep = json.loads((log_dir / "crashed" / "report.json").read_text())["crashed"]
    assert rep["tests_status"]["FAIL_TO_PASS"]["failure"] == instances[1]["FAIL_TO_PASS"]
    assert "INTERNALERROR> boom" in (log_dir / "crashed" / "test_output.txt").read_text()
    assert "no per-test result" in (log_dir / "crashed" / "run_instance.log").read_text()
    assert "no setup.py" in (log_dir / "broken-env" / "run_instance.log").read_text()


def test_only_test_modules_of_the_test_patch_run(tmp_path, hand_instances):
    _, instances = hand_instances
    data = ("diff --git a/tests/data/case.py b/tests/data/case.py\n--- /dev/null\n+++ b/tests/data/case.py\n"
            "@@ -0,0 +1 @@\n+x = (1,\n")
    inst = dict(instances[1], test_patch=instances[1]["test_patch"] + data)
    assert harness_run.test_files(inst) == ["tests/test_slug.py", "tests/test_words.py"]  # data is not a module
    (tmp_path / "tox.ini").write_text("[pytest]\npython_files = check_*.py\n")
    assert harness_run.test_files(dict(inst, FAIL_TO_PASS=[], PASS_TO_PASS=[]), tmp_path) == []  # its naming
    assert "--continue-on-collection-errors" in harness_run.test_command(inst)


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
