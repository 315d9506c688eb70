"""Fixtures: tiny git repositories with known bugs, and three hand-written SWE-bench instances."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from openglm.util.git import git, init_repo, unified_diff

sys.path.insert(0, os.path.dirname(__file__))  # bugsinpy_fixture.py (tests use --import-mode=importlib)


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))


@pytest.fixture
def make_repo(tmp_path):
    """make_repo(name, files) -> (path, sha): a git repo with one commit holding `files`."""

    def make(name: str, files: dict[str, str]) -> tuple[Path, str]:
        root = tmp_path / name
        write_files(root, files)
        return root, init_repo(root, "initial")

    return make


def _instance(repos: Path, repo: str, files: dict, fix: dict, tests: dict, f2p, p2p) -> dict:
    """One hand-written instance: buggy `files` committed; `fix`/`tests` are {file: new text}."""
    root = repos / repo.replace("/", "__")
    write_files(root, files)
    sha = init_repo(root, "buggy base")
    patch = "".join(unified_diff(rel, (root / rel).read_text(), textwrap.dedent(t).lstrip("\n"))
                    for rel, t in fix.items())
    test_patch = "".join(unified_diff(rel, (root / rel).read_text() if (root / rel).exists() else "",
                                      textwrap.dedent(t).lstrip("\n")) for rel, t in tests.items())
    test_patch = test_patch.replace("--- a/tests/test_slug.py", "--- /dev/null")  # a new file
    return {"instance_id": repo.replace("/", "__") + "-1", "repo": repo, "base_commit": sha,
            "problem_statement": f"bug in {repo}", "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "version": "0.1"}


@pytest.fixture
def hand_instances(tmp_path) -> tuple[Path, list[dict]]:
    """(repos_dir, [3 instances]): flat module + pytest, src/ layout + new test file, unittest class."""
    repos = tmp_path / "repos"
    calc = _instance(
        repos, "demo/calc",
        {"calc.py": """
            def add_tax(price, rate):
                return price * rate

            def discount(price, pct):
                return price - price * pct / 100
            """,
         "tests/test_calc.py": """
            from calc import discount

            def test_discount():
                assert discount(200, 10) == 180
            """},
        fix={"calc.py": """
            def add_tax(price, rate):
                return price * (1 + rate)

            def discount(price, pct):
                return price - price * pct / 100
            """},
        tests={"tests/test_calc.py": """
            from calc import add_tax, discount

            def test_discount():
                assert discount(200, 10) == 180

            def test_add_tax():
                assert add_tax(100, 0.5) == 150
            """},
        f2p=["tests/test_calc.py::test_add_tax"], p2p=["tests/test_calc.py::test_discount"])
    text = _instance(
        repos, "demo/textkit",
        {"src/textkit/__init__.py": """
            def slugify(s):
                return "_".join(s.lower().split())

            def count_words(s):
                return len(s.split())
            """,
         "tests/test_words.py": """
            from textkit import count_words

            def test_count_words():
                assert count_words("a b  c") == 3
            """},
        fix={"src/textkit/__init__.py": """
            def slugify(s):
                return "-".join(s.lower().split())

            def count_words(s):
                return len(s.split())
            """},
        tests={"tests/test_slug.py": """
            from textkit import slugify

            def test_slugify():
                assert slugify("Hello  World") == "hello-world"
            """},
        f2p=["tests/test_slug.py::test_slugify"], p2p=["tests/test_words.py::test_count_words"])
    stack_py = """
            class Stack:
                def __init__(self):
                    self.items = []

                def push(self, x):
                    self.items.append(x)

                def pop(self):
                    return self.items.pop(0)
            """
    stack = _instance(
        repos, "demo/stack",
        {"stack.py": stack_py,
         "tests/test_stack.py": """
            import unittest
            from stack import Stack

            class StackTest(unittest.TestCase):
                def test_push(self):
                    s = Stack()
                    s.push(1)
                    self.assertEqual(s.items, [1])
            """},
        fix={"stack.py": stack_py.replace("pop(0)", "pop()")},  # the bug: pops from the front
        tests={"tests/test_stack.py": """
            import unittest
            from stack import Stack

            class StackTest(unittest.TestCase):
                def test_push(self):
                    s = Stack()
                    s.push(1)
                    self.assertEqual(s.items, [1])

                def test_pop(self):
                    s = Stack()
                    s.push(1)
                    s.push(2)
                    self.assertEqual(s.pop(), 2)
            """},
        f2p=["tests/test_stack.py::StackTest::test_pop"], p2p=["tests/test_stack.py::StackTest::test_push"])
    return repos, [calc, text, stack]


@pytest.fixture
def commit_all():
    def commit(root: Path, message: str) -> str:
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", message)
        return git(root, "rev-parse", "HEAD").strip()

    return commit


@pytest.fixture(scope="session")
def bugsinpy_fixture(tmp_path_factory):
    """(BugsInPy checkout, repos folder) of the fixture project with a real-shaped history (bugsinpy_fixture.py)."""
    from bugsinpy_fixture import make_fixture

    return make_fixture(tmp_path_factory.mktemp("bugsinpy"))
