"""Localisation on the fixture project's real-shaped bugs (the buggy commit with the fix's tests,
as a user has it after writing the failing test), and suite mode and --python on small repositories.

Each case is a way real bugs defeated the first localiser: a bug in a nested function, a wrong
module-level constant (run at import time, outside every test), a failing assertion whose report
calls `__repr__` (run only when a test fails), a failing test whose module does not import."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import venv
from pathlib import Path

import pytest
from bugsinpy_fixture import BUGS

from openglm.cli import main
from openglm.swe.localize import LocalizeConfig, localize
from openglm.swe.testrun import InterpreterError, resolve_python
from openglm.util.git import git


def checkout_bug(repos: Path, number: int, dest: Path) -> Path:
    """The fixture project at bug `number`'s buggy commit with its fixed test files (uncommitted)."""
    source = repos / "demo__minishop"
    shas = git(source, "rev-list", "--reverse", "HEAD").split()
    buggy, fixed, _, test_file = BUGS[number]
    subprocess.run(["git", "clone", "-q", str(source), str(dest)], check=True)
    git(dest, "checkout", "-q", shas[buggy])
    git(dest, "checkout", shas[fixed], "--", test_file)
    return dest


def _functions(result: dict) -> list[str]:
    return [x["location"] for x in result["combined"]["functions"]]


def test_nested_function_is_ranked_first(tmp_path, bugsinpy_fixture):
    repo = checkout_bug(bugsinpy_fixture[1], 1, tmp_path / "r")
    result = localize(repo, ["tests/test_bulk.py::test_bulk_tier_at_ten"])
    assert _functions(result)[0] == "minishop/prices.py::bulk_price.tier"
    assert result["combined"]["lines"][0]["location"] == "minishop/prices.py:18"  # `if n > 10:`


def test_module_level_constant_is_a_candidate(tmp_path, bugsinpy_fixture):
    repo = checkout_bug(bugsinpy_fixture[1], 2, tmp_path / "r")
    result = localize(repo, ["tests/test_prices.py::PricesTest::test_with_tax"])
    # the constant runs at import time, in no test; the function reading it leads to it
    assert "minishop/prices.py::<module>" in _functions(result)[:2]
    assert "minishop/prices.py:3" in [x["location"] for x in result["combined"]["lines"][:5]]  # TAX_RATE = 0.2


def test_repr_called_only_to_report_the_failure_is_not_evidence(tmp_path, bugsinpy_fixture):
    repo = checkout_bug(bugsinpy_fixture[1], 3, tmp_path / "r")
    result = localize(repo, ["tests/test_cart.py::test_items_keep_their_order"])
    ranked = _functions(result)
    assert "minishop/cart.py::Cart.add" in ranked[:2]
    assert ranked[0] != "minishop/cart.py::Item.__repr__"
    # pytest's assertion report called Item.__repr__ (lines 11-12) only because the test failed
    sbfl = {x["location"] for x in result["techniques"]["sbfl"]["lines"]}
    assert "minishop/cart.py:11" not in sbfl and "minishop/cart.py:18" in sbfl


def test_failing_test_whose_module_does_not_import(tmp_path, bugsinpy_fixture):
    repo = checkout_bug(bugsinpy_fixture[1], 4, tmp_path / "r")
    result = localize(repo, ["tests/test_format.py::test_format_price"])
    assert result["failing_set"] == ["tests/test_format.py"]
    assert "does not import" in result["notes"][0]
    assert result["combined"]["files"][0]["location"] == "minishop/prices.py"
    assert _functions(result)[0] == "minishop/prices.py::<module>"  # where the missing name goes


def test_other_failures_are_not_the_failing_set(tmp_path, bugsinpy_fixture):
    repo = checkout_bug(bugsinpy_fixture[1], 1, tmp_path / "r")
    (repo / "tests" / "test_bulk.py").write_text((repo / "tests" / "test_bulk.py").read_text()
                                                 + "\n\ndef test_unrelated():\n    assert False\n")
    result = localize(repo, ["tests/test_bulk.py::test_bulk_tier_at_ten"])
    assert result["failing_set"] == ["tests/test_bulk.py::test_bulk_tier_at_ten"]
    assert result["other_failing"] == ["tests/test_bulk.py::test_unrelated"]


SUITE = {
    "calc.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n\n\ndef total(xs):\n    return sum(xs)\n",
    # nose-style names: not pytest's default `test_*.py`
    "tests/tests_calc.py": "from calc import mean, total\n\n\ndef test_mean():\n    assert mean([2, 4]) == 3\n\n\n"
                           "def test_total():\n    assert total([2, 4]) == 6\n",
    # a module that cannot import: reported, and the rest of the suite still runs
    "tests/tests_broken.py": "import no_such_package_anywhere\n\n\ndef test_never():\n    pass\n",
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_suite_mode_with_a_collection_error_and_nose_style_names(tmp_path, monkeypatch):
    repo = _write(tmp_path / "r", SUITE)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    result = localize(repo, [], config=LocalizeConfig(find_failing=True))
    assert result["failing_set"] == ["tests/tests_calc.py::test_mean"]
    assert list(result["collection_errors"]) == ["tests/tests_broken.py"]
    assert "no_such_package_anywhere" in result["collection_errors"]["tests/tests_broken.py"]
    assert result["tests_ran"] == 2 and not result["timed_out"]
    assert _functions(result)[0] == "calc.py::mean"
    assert not list((tmp_path / "tmp").glob("openglm-tests-*"))  # the run's results and coverage are gone


def test_suite_mode_says_why_nothing_ran(tmp_path, capsys):
    broken = "tests/tests_broken.py"
    repo = _write(tmp_path / "r", {"calc.py": SUITE["calc.py"], broken: SUITE[broken]})
    assert main(["localize", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "no tests ran: 1 test module(s) failed to import" in err and len(err.strip().splitlines()) == 1


def test_a_test_past_its_time_limit_is_stopped(tmp_path):
    repo = _write(tmp_path / "r", {"slow.py": "import time\n\n\ndef wait():\n    time.sleep(60)\n",
                                   "tests/test_slow.py": "from slow import wait\n\n\ndef test_wait():\n    wait()\n\n\n"
                                                         "def test_fast():\n    assert 1\n"})
    result = localize(repo, [], config=LocalizeConfig(find_failing=True, test_timeout=1))
    assert result["other_failing"] == ["tests/test_slow.py::test_wait"] and result["tests_ran"] == 2
    assert "time limit" in result["notes"][0]


def _venv_with_marker(path: Path) -> Path:
    """A venv whose site-packages hold a module the repository's test needs (and, through a .pth,
    this environment's pytest): the test passes only when it runs under this venv."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "marker_pkg.py").write_text("WHERE = 'the venv'\n")
    import pytest as _pytest  # the venv borrows this environment's pytest

    (site / "borrowed.pth").write_text(str(Path(_pytest.__file__).parents[1]) + "\n")
    return path


def test_python_and_venv_run_tests_in_the_repository_environment(tmp_path, capsys):
    repo = _write(tmp_path / "r", {"tests/test_env.py": textwrap.dedent("""
        import sys

        def test_env():
            import marker_pkg
            assert marker_pkg.WHERE == "the venv" and "v" in sys.prefix
        """)})
    env = _venv_with_marker(tmp_path / "v")
    assert main(["verify", str(repo), "--files", "--venv", str(env)]) == 0
    assert json.loads(capsys.readouterr().out)["tests"]["results"] == {"tests/test_env.py::test_env": "passed"}
    assert main(["verify", str(repo), "--files", "--python", str(env / "bin" / "python")]) == 0
    capsys.readouterr()
    assert main(["verify", str(repo), "--files"]) == 1  # openglm's own interpreter lacks marker_pkg
    with pytest.raises(InterpreterError, match="not a virtualenv"):
        resolve_python(venv=tmp_path)
    assert resolve_python() == sys.executable
