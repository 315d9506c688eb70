"""The bug-injection generator: mutation kinds edit one token, and on a tiny package (standing in
for a PyPI sdist) it keeps only mutants that fail a test, writes SWE-bench instances whose gold
patch resolves them in the harness and whose empty patch does not."""

from __future__ import annotations

import ast
import json
import textwrap

from openglm.retrieval.spans import functions_with_qualnames
from openglm.swe.gen.generate import GenConfig, PackageMiner, export_queries
from openglm.swe.gen.mutate import mutations_of
from openglm.swe.gen.packages import PackageSpec
from openglm.swe.harness import HarnessConfig, run_evaluation
from openglm.swe.harness.instances import load_predictions

SOURCE = textwrap.dedent("""
    class Box:
        def fits(self, size, limit=10):
            ok = True
            ok = ok and size <= limit
            return ok

    def span(lo, hi):
        width = hi - lo
        return max(width, 0)
    """).lstrip()


def test_each_kind_rewrites_one_token():
    fns = dict(functions_with_qualnames(ast.parse(SOURCE)))
    assert set(fns) == {"Box.fits", "span"}
    seen = {}
    for qual, node in fns.items():
        for m in mutations_of(SOURCE, node):
            new = m.apply(SOURCE)
            compile(new, "x", "exec")
            changed = [(a, b) for a, b in zip(SOURCE.splitlines(), new.splitlines()) if a != b]
            seen.setdefault(m.kind, []).append((m.description, new.splitlines()[m.line - 1]
                                                if m.kind != "drop_statement" else changed[0][0]))
    assert ("`<=` -> `<`", "        ok = ok and size < limit") in seen["flip_compare"]
    assert ("`-` -> `+`", "    width = hi + lo") in seen["wrong_operator"]
    assert ("`and` -> `or`", "        ok = ok or size <= limit") in seen["wrong_operator"]
    assert ("`True` -> `False`", "        ok = False") in seen["wrong_constant"]
    assert ("swapped `width` and `0`", "    return max(0, width)") in seen["swap_args"]
    assert any(d == "`0` -> `1`" for d, _ in seen["off_by_one"])
    assert ("dropped `ok = True`", "        ok = True") in seen["drop_statement"]


PACKAGE = {
    "tinylib/__init__.py": "",
    "tinylib/core.py": """
        def ratio(a, b):
            return round(a / b, 2)

        def mean(values):
            total = 0
            for v in values:
                total += v
            return total / len(values)
        """,
    "tests/test_core.py": """
        from tinylib.core import mean, ratio

        def test_ratio():
            assert ratio(1, 4) == 0.25

        def test_mean():
            assert mean([1, 2, 3, 6]) == 3
        """,
}


def test_generated_instances_grade_like_swebench(tmp_path, make_repo):
    spec = PackageSpec("tinylib", "0.1", ("tinylib",), ("tests",))
    # put the package where fetch_package would have unpacked its sdist
    repo, _ = make_repo(f"gen/repos/pypi__{spec.slug}", PACKAGE)
    config = GenConfig(out_dir=tmp_path / "gen", per_package=2, seed=1, max_tries_per_function=8)
    instances = PackageMiner(spec, config).mine()
    assert len(instances) == 2
    for inst in instances:
        bug = inst["openglm_bug"]
        assert bug["file"] == "tinylib/core.py" and bug["function"] in ("ratio", "mean")
        assert inst["FAIL_TO_PASS"] and not set(inst["FAIL_TO_PASS"]) & set(inst["PASS_TO_PASS"])
        assert inst["FAIL_TO_PASS"][0] in inst["problem_statement"]
    assert (repo / "tinylib/core.py").read_text() == textwrap.dedent(PACKAGE["tinylib/core.py"]).lstrip()
    config = HarnessConfig(run_id="gen", out_dir=tmp_path / "out", repos_dir=tmp_path / "gen" / "repos",
                           workers=2, timeout=120)
    gold = run_evaluation(instances, load_predictions("gold", instances), config)
    empty = run_evaluation(instances, load_predictions("empty", instances), config)
    assert gold["resolved_instances"] == len(instances) and empty["resolved_instances"] == 0
    export_queries(instances, tmp_path / "q.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["function"] for r in rows] == [i["openglm_bug"]["function"] for i in instances]


def _single_module_package(counter) -> dict:
    """A one-module package (laid out like `parse`: tinymod.py at the root) with three traps:
    `ratio` gives honest mutants; every mutant of `load` fails its covering test alone but passes
    inside the whole file (an earlier test warms the cache): order-dependent; `shout`'s test file
    holds a test that fails on every other run: flaky."""
    return {
        "tinymod.py": """
            _cache = {}

            def ratio(a, b):
                return round(a / b, 2)

            def load(key):
                if key not in _cache:
                    _cache[key] = key.upper()
                return _cache[key]

            def shout(word):
                return word.upper() + "!"
            """,
        "tests/test_mod.py": """
            import tinymod

            def test_ratio():
                assert tinymod.ratio(1, 4) == 0.25

            def test_a_warms_the_cache():
                tinymod._cache["x"] = "X"

            def test_load():
                assert tinymod.load("x") == "X"
            """,
        "tests/test_flaky.py": f"""
            import pathlib

            import tinymod

            COUNTER = pathlib.Path({str(counter)!r})

            def test_shout():
                assert tinymod.shout("a") == "A!"

            def test_every_other_run():
                n = int(COUNTER.read_text()) if COUNTER.exists() else 0
                COUNTER.write_text(str(n + 1))
                assert n % 2 == 0
            """,
    }


def test_mutants_are_validated_as_the_harness_grades_them(tmp_path, make_repo):
    spec = PackageSpec("tinymod", "0.1", ("tinymod.py",), ("tests",))
    make_repo(f"gen/repos/pypi__{spec.slug}", _single_module_package(tmp_path / "counter"))
    config = GenConfig(out_dir=tmp_path / "gen", per_package=3, seed=0, max_tries_per_function=4)
    miner = PackageMiner(spec, config)
    instances = miner.mine()
    # a single-module package is measured (coverage.py cannot take a file as its source)
    assert {i["openglm_bug"]["function"] for i in instances} == {"ratio"} and len(instances) == 1
    # load's mutants and shout's mutants were screened in, then refused for the right reasons
    assert miner.rejected["FAIL_TO_PASS differs when graded"] >= 1
    assert miner.rejected["flaky or ungradable"] >= 1
    (inst,) = instances
    # graded over the whole test file: PASS_TO_PASS holds tests that never run the buggy line
    assert inst["FAIL_TO_PASS"] == ["tests/test_mod.py::test_ratio"]
    assert inst["PASS_TO_PASS"] == ["tests/test_mod.py::test_a_warms_the_cache", "tests/test_mod.py::test_load"]
    config = HarnessConfig(run_id="v", out_dir=tmp_path / "out", repos_dir=tmp_path / "gen" / "repos", timeout=120)
    assert run_evaluation(instances, load_predictions("gold", instances), config)["resolved_instances"] == 1
    assert run_evaluation(instances, load_predictions("empty", instances), config)["resolved_instances"] == 0
