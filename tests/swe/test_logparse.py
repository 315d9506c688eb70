"""Log parsing on real runner output: pytest -rA (ids with spaces, messages) and unittest -v."""

from __future__ import annotations

import subprocess
import sys

from openglm.swe.logparse import parse_log, parse_pytest_log, parse_unittest_log

TESTS = '''
import unittest
import pytest

@pytest.mark.parametrize("text", ["a b", "c - d"])
def test_param(text):
    assert " " in text and text != "c - d"

class Case(unittest.TestCase):
    def test_ok(self):
        pass

    def test_err(self):
        raise KeyError("x")

    @unittest.skip("no")
    def test_skip(self):
        pass
'''


def test_pytest_and_unittest_logs(tmp_path):
    (tmp_path / "test_mix.py").write_text(TESTS)
    py = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_mix.py"],
                        cwd=tmp_path, capture_output=True, text=True).stdout
    assert parse_pytest_log(py) == {
        "test_mix.py::test_param[a b]": "PASSED", "test_mix.py::test_param[c - d]": "FAILED",
        "test_mix.py::Case::test_ok": "PASSED", "test_mix.py::Case::test_err": "FAILED"}
    # pytest's skip summary (`SKIPPED [1] file:line: reason`) names no test: a skip never counts as a pass
    ut = subprocess.run([sys.executable, "-m", "unittest", "-v", "test_mix.Case"], cwd=tmp_path,
                        capture_output=True, text=True).stderr
    assert parse_unittest_log(ut) == {"test_ok (test_mix.Case.test_ok)": "PASSED",
                                      "test_err (test_mix.Case.test_err)": "ERROR",
                                      "test_skip (test_mix.Case.test_skip)": "SKIPPED"}
    assert parse_log(ut) == parse_unittest_log(ut) and parse_log("nothing here") == {}
