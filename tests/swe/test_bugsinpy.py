"""The real-bug builder (BugsInPy metadata -> SWE-bench instances) on the fixture project: the fix is
split into gold and test patches, unittest names become node ids, reproduction is checked by grading
both ways (a bug whose test passes without the fix is skipped with the reason), and the instance
grades gold -> resolved, empty -> unresolved. Plus the pure parts: reading run_test.sh, locating the
fix in the buggy tree, and relaxing pins from pip's own words."""

from __future__ import annotations

import json
import shutil

from openglm.swe.gen.bugsinpy import (
    BugsInPyConfig,
    _hunk_old_lines,
    build,
    clean_requirements,
    failing_requirement,
    node_ids,
    read_bug,
    relax,
)
from openglm.swe.harness import HarnessConfig, run_evaluation
from openglm.swe.harness.instances import load_instances, load_predictions


def test_builder_reproduces_grades_and_skips(tmp_path, bugsinpy_fixture):
    bugsinpy, repos = bugsinpy_fixture
    config = BugsInPyConfig(bugsinpy_dir=bugsinpy, repos_dir=repos, out_dir=tmp_path / "out",
                            bugs=("minishop-2", "minishop-5"), timeout=120)
    instances = load_instances(build(config))
    (inst,) = instances
    assert inst["instance_id"] == "minishop-2" and inst["repo"] == "demo/minishop"
    # `python -m unittest tests.test_prices.PricesTest.test_with_tax` became a node id
    assert inst["FAIL_TO_PASS"] == ["tests/test_prices.py::PricesTest::test_with_tax"]
    assert inst["PASS_TO_PASS"] == ["tests/test_prices.py::PricesTest::test_discount",
                                    "tests/test_prices.py::PricesTest::test_negative_discount"]
    assert "b/minishop/prices.py" in inst["patch"] and "tests/" not in inst["patch"]
    assert "b/tests/test_prices.py" in inst["test_patch"] and "minishop/" not in inst["test_patch"]
    assert inst["openglm_bug"] == {"files": ["minishop/prices.py"], "functions": ["minishop/prices.py::<module>"],
                                   "lines": ["minishop/prices.py:3"]}
    skipped = [json.loads(x) for x in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert skipped == [{"instance_id": "minishop-5",
                        "reason": "tests/test_prices.py::PricesTest::test_zero_discount passes without the fix"}]
    harness = HarnessConfig(run_id="b", out_dir=tmp_path / "eval", repos_dir=repos, timeout=120)
    assert run_evaluation(instances, load_predictions("gold", instances), harness)["resolved_ids"] == ["minishop-2"]
    harness.run_id = "e"
    empty = run_evaluation(instances, load_predictions("empty", instances), harness)
    assert empty["unresolved_ids"] == ["minishop-2"] and empty["error_ids"] == []
    # a rerun reads every bug's outcome from the cache
    cached = tmp_path / "out" / "bugs" / "minishop-2.v1.json"
    before = cached.stat().st_mtime_ns
    assert load_instances(build(config)) == instances and cached.stat().st_mtime_ns == before


def test_run_test_lines_become_node_ids():
    files = {"test/test_utils.py", "tests/test_black.py"}
    assert node_ids(["python -m unittest -q test.test_utils.TestUtil.test_match_str",
                     "pytest -q -s tests/test_x.py::test_a tests/test_x.py::test_b",
                     "tox tests/test_hooks.py::TestFindHooks::test_find_hook",
                     "python3 -m pytest tqdm/tests/tests_contrib.py::test_enumerate"], files) == [
        "test/test_utils.py::TestUtil::test_match_str", "tests/test_x.py::test_a", "tests/test_x.py::test_b",
        "tests/test_hooks.py::TestFindHooks::test_find_hook", "tqdm/tests/tests_contrib.py::test_enumerate"]


def test_fix_location_in_the_buggy_tree():
    patch = ("diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -10,4 +10,4 @@ def f():\n"
             "     a = 1\n-    b = 2\n+    b = 3\n     c = 4\n@@ -30,3 +30,5 @@\n x\n y\n+z1\n+z2\n w\n")
    # a replaced line is the removed one; pure additions point at the lines around them
    assert _hunk_old_lines(patch) == {"m.py": {11, 31, 32}}


def test_requirements_from_bugsinpy_files(tmp_path, bugsinpy_fixture):
    bugsinpy = tmp_path / "BugsInPy"
    shutil.copytree(bugsinpy_fixture[0], bugsinpy)
    folder = bugsinpy / "projects" / "minishop" / "bugs" / "1"
    bug = read_bug(bugsinpy, "minishop", 1)
    assert bug.repo == "demo/minishop" and bug.fix_files == ["minishop/prices.py"] and not bug.install
    assert clean_requirements(bug) == []  # none: the harness's own packages
    # BugsInPy ships some requirements files in UTF-16, and the project itself as an `-e` line
    lines = "six==1.15.0\r\n-e git+https://github.com/demo/minishop@1#egg=minishop\r\npkg-resources==0.0.0\r\n"
    (folder / "requirements.txt").write_bytes(lines.encode("utf-16"))
    bug = read_bug(bugsinpy, "minishop", 1)
    assert bug.install and clean_requirements(bug) == ["pytest", "six==1.15.0", "wheel"]


def test_pins_are_relaxed_by_what_pip_blames():
    reqs = ["mypy==0.770", "pytest==3.10.1", "typed-ast", "py==1.8.1"]
    # a version another pin asks for does not build: the pin that asked is relaxed, not the package
    log = "Collecting mypy==0.770\nCollecting typed_ast<1.5.0,>=1.4.0 (from mypy==0.770)\nFailed to build typed-ast\n"
    assert failing_requirement(log, reqs) == "mypy==0.770"
    conflict = ("ERROR: Cannot install py==1.8.1 and pytest==6.2.5\nThe conflict is caused by:\n"
                "    The user requested py==1.8.1\n    pytest 6.2.5 depends on py>=1.8.2\n")
    assert failing_requirement(conflict, reqs) == "py==1.8.1"
    assert failing_requirement("ERROR: No matching distribution found for nothing-here==1\n", reqs) is None
    assert relax(reqs, "py==1.8.1")[0] == ["mypy==0.770", "pytest==3.10.1", "typed-ast", "py"]
    assert relax(reqs, "typed-ast")[0] == ["mypy==0.770", "pytest==3.10.1", "py==1.8.1"]
