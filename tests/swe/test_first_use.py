"""`openglm localize` / `openglm verify` as a first user calls them."""

import json
import textwrap

from openglm.cli import main


def _repo(tmp_path, broken: bool):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a %s b\n" % ("-" if broken else "+"))
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_calc.py").write_text(textwrap.dedent("""\
        import unittest

        import calc


        class TestCalc(unittest.TestCase):
            def test_add(self):
                self.assertEqual(calc.add(2, 2), 4)

            def test_zero(self):
                self.assertEqual(calc.add(0, 0), 0)
        """))
    return repo


def test_localize_without_failing_runs_the_suite_and_ranks_the_bug(tmp_path, capsys):
    repo = _repo(tmp_path, broken=True)
    assert main(["localize", str(repo), "--top", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["observed_failing"] == ["tests/test_calc.py::TestCalc::test_add"]
    assert result["combined"]["functions"][0]["location"].startswith("calc.py")


def test_localize_with_nothing_failing_tells_the_user(tmp_path, capsys):
    repo = _repo(tmp_path, broken=False)
    assert main(["localize", str(repo)]) == 1
    err = capsys.readouterr().err.strip()
    assert "no test of the suite failed" in err and "--failing" in err and len(err.splitlines()) == 1


def test_verify_unittest_without_tests_runs_discovery(tmp_path, capsys):
    repo = _repo(tmp_path, broken=False)
    assert main(["verify", str(repo), "--runner", "unittest", "--files", "calc.py"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"], result
    assert result["tests"]["passed"] == 2 and result["tests"]["failed"] == []  # not one "discover" failure
