"""verify: compile errors, Pyflakes findings and per-test results from pytest and unittest."""

from __future__ import annotations

from openglm.swe.verify import VerifyConfig, verify

FILES = {
    "mod.py": """
        def double(x):
            return 2 * x
        """,
    "test_mod.py": """
        import unittest
        from mod import double

        class DoubleTest(unittest.TestCase):
            def test_two(self):
                self.assertEqual(double(2), 4)

            def test_zero(self):
                self.assertEqual(double(0), 1)
        """,
}


def test_pytest_results_per_test(make_repo):
    repo, _ = make_repo("v1", FILES)
    result = verify(repo, tests=["test_mod.py"])
    assert result["tests"]["results"] == {"test_mod.py::DoubleTest::test_two": "passed",
                                          "test_mod.py::DoubleTest::test_zero": "failed"}
    assert result["ok"] is False and result["files"] == []  # nothing changed vs HEAD
    assert "AssertionError" in result["tests"]["failures"]["test_mod.py::DoubleTest::test_zero"]


def test_unittest_runner_and_static_checks(make_repo):
    repo, _ = make_repo("v2", FILES)
    (repo / "mod.py").write_text("import os\n\ndef double(x):\n    return 2 * y\n")
    (repo / "broken.py").write_text("def f(:\n")
    result = verify(repo, tests=["test_mod"], config=VerifyConfig(runner="unittest"))
    assert result["files"] == ["broken.py", "mod.py"]
    assert [c["ok"] for c in result["compile"]] == [False, True]
    messages = {m["message"] for m in result["pyflakes"]}
    assert any("'os' imported but unused" in m for m in messages)
    assert any("undefined name 'y'" in m for m in messages)
    assert result["tests"]["results"] == {"test_two (test_mod.DoubleTest.test_two)": "error",
                                          "test_zero (test_mod.DoubleTest.test_zero)": "error"}
    assert result["ok"] is False and result["pyflakes_clean"] is False
