"""The SWE checks run the repository's own test runner: unittest suites through unittest, pytest
suites through pytest, with results keyed by pytest node id either way."""

import json
import subprocess
import sys
import textwrap

from openglm.swe.policy.checks import MARKER
from openglm.swe.testrun import node_id, repo_runner, run_tests, unittest_name

UNITTEST_SUITE = textwrap.dedent("""
    import unittest
    from calc import add

    class TestCalc(unittest.TestCase):
        def test_add(self):
            self.assertEqual(add(2, 3), 5)

        def test_neg(self):
            self.assertEqual(add(-1, -1), -2)
""")


def _repo(tmp_path, body=UNITTEST_SUITE, bug=True):
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n" if bug
                                      else "def add(a, b):\n    return a + b\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_calc.py").write_text(body)
    return tmp_path


def test_unittest_repo_runs_under_unittest_with_node_ids(tmp_path):
    repo = _repo(tmp_path)
    assert repo_runner(repo) == "unittest"
    run = run_tests(repo, [])
    assert run.failed == ["tests/test_calc.py::TestCalc::test_add", "tests/test_calc.py::TestCalc::test_neg"]
    one = run_tests(repo, ["tests/test_calc.py::TestCalc::test_add"])
    assert list(one.results) == ["tests/test_calc.py::TestCalc::test_add"]


def test_pytest_repo_is_detected(tmp_path):
    repo = _repo(tmp_path, "import pytest\nfrom calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n",
                 bug=False)
    assert repo_runner(repo) == "pytest"
    assert run_tests(repo, []).passed == ["tests/test_calc.py::test_add"]


def test_names_convert_both_ways(tmp_path):
    repo = _repo(tmp_path)
    assert unittest_name("tests/test_calc.py::TestCalc::test_add") == "tests.test_calc.TestCalc.test_add"
    assert node_id(repo, "test_add (tests.test_calc.TestCalc.test_add)") == "tests/test_calc.py::TestCalc::test_add"
    assert node_id(repo, "test_add (tests.test_calc.TestCalc)") == "tests/test_calc.py::TestCalc::test_add"


def test_policy_suite_check_uses_the_repository_runner(tmp_path):
    repo = _repo(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "openglm.swe.policy.checks", "suite"], input="{}", cwd=repo,
                          capture_output=True, text=True, timeout=120)
    data = json.loads(proc.stdout.strip().splitlines()[-1][len(MARKER):])
    assert data["runner"] == "unittest" and not data["ok"] and len(data["failed"]) == 2



def test_unittest_suites_outside_packages_run_under_pytest(tmp_path):
    repo = _repo(tmp_path)
    (repo / "tests" / "__init__.py").unlink()  # `unittest discover` would find nothing
    assert repo_runner(repo) == "pytest"
    failed = run_tests(repo, []).failed
    assert failed == ["tests/test_calc.py::TestCalc::test_add", "tests/test_calc.py::TestCalc::test_neg"]
