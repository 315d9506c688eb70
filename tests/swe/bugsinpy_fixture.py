"""A small project with a real-shaped history of bugs and fixes, and BugsInPy metadata for it.

CI cannot clone public repositories, so the real-bug builder and the localisation on real bugs are
tested on this instead. `make_fixture(root)` writes, deterministically (fixed git identity and dates):

- `root/repos/demo__minishop`: a git history of nine commits; four of them bring a bug that a later
  commit fixes together with a test that exposes it, the way real projects' histories look;
- `root/BugsInPy/projects/minishop`: `project.info` and, per bug, `bug.info` (buggy/fixed commits,
  test files), `run_test.sh` (pytest node ids, a unittest dotted name, pytest options),
  `requirements.txt` (none: the harness's own pytest) and `bug_patch.txt` (the fix's source part).

The bugs: (1) a nested function's comparison, (2) a module-level constant, (3) a list that a method
builds in the wrong order, where the failing assertion calls `Item.__repr__` only to report the
failure, (4) a function the fix adds and the new test imports (its module fails to import before the
fix), (5) a "fix" whose new test already passes at the buggy commit (not reproducible).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from openglm.util.git import git

PRICES_V0 = '''
"""Prices with tax and discounts."""

TAX_RATE = 0.25


def with_tax(amount):
    return round(amount * (1 + TAX_RATE), 2)


def discount(amount, pct):
    if pct < 0:
        raise ValueError("negative discount")
    return round(amount - amount * pct / 100, 2)
'''

BULK = '''

def bulk_price(unit, qty):
    def tier(n):
        if n {cmp} 10:
            return 0.9
        return 1.0

    total = unit * qty
    return round(total * tier(qty), 2)
'''

FORMAT = '''

def format_price(amount):
    return f"{amount:.2f} EUR"
'''

CART_V0 = '''
class Item:
    def __init__(self, name, price):
        self.name = name
        self.price = price

    def __eq__(self, other):
        return (self.name, self.price) == (other.name, other.price)

    def __repr__(self):
        return f"Item({self.name!r}, {self.price!r})"


class Cart:
    def __init__(self):
        self.items = []

    def add(self, item):
        {add}

    def total(self):
        return sum(item.price for item in self.items)
'''

TEST_PRICES_V0 = '''
import unittest

from minishop.prices import discount, with_tax


class PricesTest(unittest.TestCase):
    def test_discount(self):
        self.assertEqual(discount(200, 10), 180)

    def test_negative_discount(self):
        with self.assertRaises(ValueError):
            discount(1, -1)
'''

TEST_TAX = '''
    def test_with_tax(self):
        self.assertEqual(with_tax(100), 125)
'''

TEST_BULK = '''

def test_bulk_small():
    from minishop.prices import bulk_price

    assert bulk_price(2, 3) == 6


def test_bulk_tier_at_ten():
    from minishop.prices import bulk_price

    assert bulk_price(1, 10) == 9
'''

TEST_CART_V0 = '''
from minishop.cart import Cart, Item


def test_total():
    cart = Cart()
    cart.add(Item("a", 2))
    cart.add(Item("b", 3))
    assert cart.total() == 5
'''

TEST_ORDER = '''

def test_items_keep_their_order():
    cart = Cart()
    cart.add(Item("a", 2))
    cart.add(Item("b", 3))
    assert cart.items == [Item("a", 2), Item("b", 3)]
'''

TEST_FORMAT = '''
from minishop.prices import format_price


def test_format_price():
    assert format_price(3) == "3.00 EUR"
'''

TEST_DISCOUNT_ZERO = '''
    def test_zero_discount(self):
        self.assertEqual(discount(50, 0), 50)
'''


def _commit(repo: Path, files: dict[str, str], message: str, n: int) -> str:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    git(repo, "add", "-A")
    date = f"2024-01-{n + 1:02d}T12:00:00Z"  # a history spread over days: git blame tells lines apart
    git(repo, "commit", "-q", "--no-verify", "-m", message,
        env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})
    return git(repo, "rev-parse", "HEAD").strip()


def make_history(repo: Path) -> list[str]:
    """The project's commits, oldest first."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    prices = PRICES_V0
    shas = [_commit(repo, {"minishop/__init__.py": "", "minishop/prices.py": prices,
                           "minishop/cart.py": CART_V0.replace("{add}", "self.items.append(item)"),
                           "tests/test_prices.py": TEST_PRICES_V0, "tests/test_cart.py": TEST_CART_V0,
                           "README.md": "# minishop\n"}, "minishop: prices and a cart", 0)]
    prices += BULK.replace("{cmp}", ">")  # bug 1: the tier starts above 10, not at 10
    first_bulk_test = TEST_BULK.split("\n\ndef test_bulk_tier")[0] + "\n"
    shas.append(_commit(repo, {"minishop/prices.py": prices, "tests/test_bulk.py": first_bulk_test},
                        "bulk pricing with a tier discount", 1))
    prices = prices.replace("if n > 10", "if n >= 10")
    shas.append(_commit(repo, {"minishop/prices.py": prices, "tests/test_bulk.py": TEST_BULK},
                        "fix the bulk tier boundary", 2))
    prices = prices.replace("TAX_RATE = 0.25", "TAX_RATE = 0.2")  # bug 2
    readme = "# minishop\n\nTax: see prices.py\n"
    shas.append(_commit(repo, {"minishop/prices.py": prices, "README.md": readme},
                        "tax rate from the new regulation", 3))
    prices = prices.replace("TAX_RATE = 0.2", "TAX_RATE = 0.25")
    shas.append(_commit(repo, {"minishop/prices.py": prices, "tests/test_prices.py": TEST_PRICES_V0 + TEST_TAX},
                        "the regulation was not adopted: back to 25%", 4))
    cart = CART_V0.replace("{add}", "self.items.insert(0, item)")  # bug 3: newest first
    shas.append(_commit(repo, {"minishop/cart.py": cart}, "cart: newest item first", 5))
    shas.append(_commit(repo, {"minishop/cart.py": CART_V0.replace("{add}", "self.items.append(item)"),
                               "tests/test_cart.py": TEST_CART_V0 + TEST_ORDER},
                        "cart: keep the order items came in", 6))
    shas.append(_commit(repo, {"minishop/prices.py": prices + FORMAT, "tests/test_format.py": TEST_FORMAT},
                        "format prices for display", 7))
    # not a fix: the discount was right; the new test passes before the change too
    prices = prices.replace('"""Prices with tax and discounts."""', '"""Prices with tax, discounts and tiers."""')
    shas.append(_commit(repo, {"minishop/prices.py": prices,
                               "tests/test_prices.py": TEST_PRICES_V0 + TEST_TAX + TEST_DISCOUNT_ZERO},
                        "test a zero discount", 8))
    return shas


# bug number -> (index of the buggy commit, of the fixed commit, run_test.sh, test files)
BUGS = {
    1: (1, 2, "pytest tests/test_bulk.py::test_bulk_tier_at_ten", "tests/test_bulk.py"),
    2: (3, 4, "python -m unittest -q tests.test_prices.PricesTest.test_with_tax", "tests/test_prices.py"),
    3: (5, 6, "pytest -q -s tests/test_cart.py::test_items_keep_their_order", "tests/test_cart.py"),
    4: (6, 7, "pytest tests/test_format.py::test_format_price", "tests/test_format.py"),
    5: (7, 8, "python -m unittest -q tests.test_prices.PricesTest.test_zero_discount", "tests/test_prices.py"),
}


def make_fixture(root: Path) -> tuple[Path, Path]:
    """(BugsInPy checkout, repos folder) under `root`."""
    repo = root / "repos" / "demo__minishop"
    shas = make_history(repo)
    project = root / "BugsInPy" / "projects" / "minishop"
    project.mkdir(parents=True)
    (project / "project.info").write_text('github_url="https://github.com/demo/minishop"\nstatus="OK"\n')
    for number, (buggy, fixed, run_test, test_file) in BUGS.items():
        folder = project / "bugs" / str(number)
        folder.mkdir(parents=True)
        (folder / "bug.info").write_text(f'python_version="3.8.3"\nbuggy_commit_id="{shas[buggy]}"\n'
                                         f'fixed_commit_id="{shas[fixed]}"\ntest_file="{test_file}"\n')
        (folder / "run_test.sh").write_text(run_test + "\n")
        (folder / "requirements.txt").write_text("")
        changed = git(repo, "diff", "--name-only", shas[buggy], shas[fixed]).split()
        source = [f for f in changed if f.startswith("minishop/")]
        (folder / "bug_patch.txt").write_text(git(repo, "diff", shas[buggy], shas[fixed], "--", *source))
    return root / "BugsInPy", root / "repos"
