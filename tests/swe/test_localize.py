"""Localisation on a tiny package with a planted bug: each technique finds it for its own reason,
and the combination ranks the buggy function first and the buggy line in the top 5."""

from __future__ import annotations

import pytest

from openglm.retrieval.spans import FunctionIndex
from openglm.swe.localize import localize
from openglm.swe.localize.sbfl import SEGMENT_WEIGHT, ochiai
from openglm.swe.localize.text import text_scores, tokens
from openglm.swe.localize.traceback import import_scores, missing_names, parse_frames, traceback_scores

FILES = {
    "shop/__init__.py": "",
    "shop/prices.py": """
        from shop.units import to_cents

        def total(items):
            cents = 0
            for price, qty in items:
                cents += to_cents(price) * qty
            return cents

        def apply_discount(cents, percent):
            if percent < 0:
                raise ValueError("negative discount")
            off = cents * percent // 100
            return cents + off

        def describe(cents):
            return f"{cents / 100:.2f} EUR"
        """,
    "shop/units.py": """
        def to_cents(price):
            return round(price * 100)

        def from_cents(cents):
            return cents / 100
        """,
    "tests/test_prices.py": """
        from shop.prices import apply_discount, describe, total

        def test_total():
            assert total([(1.5, 2), (0.25, 4)]) == 400

        def test_describe():
            assert describe(1234) == "12.34 EUR"

        def test_discount():
            assert apply_discount(1000, 10) == 900

        def test_no_discount():
            assert apply_discount(1000, 0) == 1000
        """,
}
FAILING = ["tests/test_prices.py::test_discount"]
ISSUE = "apply_discount adds the discount instead of subtracting it: 1000 cents at 10 percent gives 1100"


@pytest.fixture
def shop(make_repo):
    return make_repo("shop", FILES)[0]


def test_combined_ranks_the_buggy_function_and_line(shop):
    result = localize(shop, FAILING, issue=ISSUE)
    assert result["observed_failing"] == FAILING
    combined = result["combined"]
    assert combined["files"][0]["location"] == "shop/prices.py"
    assert combined["functions"][0]["location"] == "shop/prices.py::apply_discount"
    top5 = [x["location"] for x in combined["lines"][:5]]
    assert "shop/prices.py:13" in top5  # `return cents + off`
    assert set(result["techniques"]) == {"sbfl", "traceback", "text", "tests"}


def test_sbfl_scores_lines_only_failing_tests_run(shop):
    result = localize(shop, FAILING)  # no issue text: SBFL + the failure's traceback only
    sbfl = {x["location"]: x["score"] for x in result["techniques"]["sbfl"]["lines"]}
    # line 13 runs in 1 failing + 1 passing test -> 1/sqrt(2), per test and per assertion segment (each
    # test has one assertion: its only segment); test_total's lines never fail
    assert sbfl["shop/prices.py:13"] == pytest.approx((1 + SEGMENT_WEIGHT) * ochiai(1, 1, 1), abs=1e-4)
    assert "shop/prices.py:6" not in sbfl and "shop/units.py:2" not in sbfl
    assert ochiai(2, 0, 2) == 1.0 and ochiai(0, 3, 2) == 0.0


def test_traceback_formats_and_depth(shop):
    native = ('Traceback (most recent call last):\n  File "tests/test_prices.py", line 10, in test_x\n'
              f'  File "{shop}/shop/prices.py", line 3, in total\n'
              '  File "shop/units.py", line 2, in to_cents\nTypeError: bad\n')
    frames = parse_frames(native)
    assert [(f.path.split("/")[-1], f.line, f.func) for f in frames][-1] == ("units.py", 2, "to_cents")
    pytest_style = "tests/test_prices.py:10: in test_x\n    y\nshop/prices.py:11: ValueError\n"
    assert [(f.path, f.line) for f in parse_frames(pytest_style)] == [("tests/test_prices.py", 10),
                                                                      ("shop/prices.py", 11)]
    scores = traceback_scores(FunctionIndex(shop), [native])
    # the deepest repo frame wins, test files are left out
    assert scores["functions"] == {"shop/units.py::to_cents": 1.0, "shop/prices.py::total": 0.5}


def test_text_similarity_splits_identifiers(shop):
    assert {"apply", "discount"} <= set(tokens("applyDiscount apply_discount"))
    scores = text_scores(FunctionIndex(shop), "the from_cents conversion is wrong")
    assert max(scores["functions"], key=scores["functions"].get) == "shop/units.py::from_cents"


PAD_FILES = {
    "fmt/__init__.py": "",
    "fmt/num.py": """
        def thousands(n):
            if n >= 1000:
                return thousands(n // 1000) + "," + pad(n % 1000)
            return str(n)

        def pad(r):
            if r < 10:
                return "0" + str(r)
            if r < 100:
                return "0" + str(r)
            return str(r)
        """,
    "tests/test_num.py": """
        import unittest

        from fmt.num import thousands

        def test_thousands():
            assert thousands(5) == "5"
            assert thousands(1234) == "1,234"
            assert thousands(1050) == "1,050"
            assert thousands(1005) == "1,005"

        class ThousandsTest(unittest.TestCase):
            def test_thousands(self):
                self.assertEqual(thousands(5), "5")
                self.assertEqual(thousands(1234), "1,234")
                self.assertEqual(thousands(1050), "1,050")
                self.assertEqual(thousands(1005), "1,005")
        """,
}


@pytest.mark.parametrize("test", ["tests/test_num.py::test_thousands",
                                  "tests/test_num.py::ThousandsTest::test_thousands"])
def test_what_ran_before_a_passing_assertion_passed(make_repo, test):
    """One failing test, so every line it runs has Ochiai 1 per test; the assertions that passed before
    the failing one (plain `assert` and unittest's assertEqual) make the earlier calls passing
    executions: only the branch the failing call alone took keeps a perfect score."""
    repo = make_repo("fmt", PAD_FILES)[0]
    result = localize(repo, [test])
    sbfl = {x["location"]: x["score"] for x in result["techniques"]["sbfl"]["lines"]}
    bug = "fmt/num.py:8"  # `return "0" + str(r)` under `if r < 10`
    assert sbfl[bug] == pytest.approx(1 + SEGMENT_WEIGHT, abs=1e-4)
    assert all(s < sbfl[bug] for loc, s in sbfl.items() if loc != bug)
    assert result["combined"]["lines"][0]["location"] == bug



def test_missing_names_point_at_their_module_or_class(make_repo):
    repo = make_repo("money", {"money/__init__.py": "", "money/core.py": """
        class Money:
            def to_cents(self):
                return 1

        class Rate:
            def from_cents(self):
                return 2
        """})[0]
    index = FunctionIndex(repo)
    text = ("E   ImportError: cannot import name 'parse_money' from 'money.core' (money/core.py)\n"
            "E   AttributeError: 'Money' object has no attribute 'from_cents'\n")
    assert missing_names(index, text) == [("money/core.py", "parse_money", ""),
                                          ("money/core.py", "from_cents", "Money")]
    fns = import_scores(index, [text], "<module>")["functions"]
    assert fns["money/core.py::<module>"] == 1.0  # a missing import is usually module-level code
    # the class that lacks the method, by the words its methods share with it; not another class's
    assert fns["money/core.py::Money.to_cents"] > 0
    assert "money/core.py::Rate.from_cents" not in fns
