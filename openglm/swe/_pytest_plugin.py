"""A pytest plugin (loaded with `-p openglm.swe._pytest_plugin`) that records, per test node id,
the outcome, the failure text and - when asked - the lines it executed.

Why a plugin rather than parsing pytest's console output: node ids, outcomes and per-test coverage
contexts come straight from pytest's hooks, so parametrised tests, unittest classes and odd names
need no parsing. It runs under the repository's own pytest (3.x to 9.x), so it uses only hooks and
attributes those versions share, and nothing of openglm but this file.

Code that runs only to describe a failure - pytest's assertion rewriting calling `repr()` on the
compared values, unittest formatting its `a != b` message - is recorded under the context
`<nodeid>|report`, so localisation does not mistake a `__repr__` for the code under test.

Each assertion that passes inside a test starts a new coverage context, `<nodeid>|1`, `<nodeid>|2`,
...: what ran before a passing assertion is a passing execution even when a later assertion of the
same test fails, and only the last segment of a failing test holds the failing one. Passing
assertions are seen through pytest's `pytest_assertion_pass` hook (pytest >= 5 with rewriting on;
testrun turns `enable_assertion_pass_hook` on) and by wrapping unittest's `assert*` methods.

Each finished test is appended to the results file as one JSON line at once, so a run killed at its
time limit still leaves what it finished. A module that fails to import is a `collect_error` entry
keyed by the module's node id. Environment variables (set by `openglm.swe.testrun`):
  OPENGLM_RESULTS      path of the JSON-lines file to append to ({"nodeid", "outcome", "longrepr"})
  OPENGLM_COV_DATA     path of a coverage data file; when set, coverage contexts are named by node id
  OPENGLM_COV_SOURCE   os.pathsep-separated source dirs to measure (default: the rootdir)
  OPENGLM_TEST_TIMEOUT seconds one test may run before it is stopped (outcome `timeout`)
  OPENGLM_DEADLINE     epoch seconds after which no further test starts (the run's time budget)
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

_results: dict[str, dict] = {}
_cov = None
_out = None
REPORT_SUFFIX = "|report"  # coverage context of failure-reporting code: `<nodeid>|report`
_current = {"nodeid": "", "depth": 0, "segment": 0, "asserting": 0}
# (module, function) pairs that run only to describe a failed assertion
_REPORTERS = [("_pytest.assertion.rewrite", "_saferepr"), ("_pytest.assertion.rewrite", "_call_reprcompare"),
              ("_pytest.assertion.rewrite", "_format_assertmsg"), ("unittest.case", "safe_repr"),
              ("unittest.case", "_common_shorten_repr")]


class TestTimeout(BaseException):
    """Raised in a test that overran OPENGLM_TEST_TIMEOUT (a BaseException: `except Exception` in
    the code under test must not swallow it)."""


def pytest_configure(config):
    global _cov, _out
    path = os.environ.get("OPENGLM_RESULTS")
    if path and _out is None:
        _out = open(path, "a", encoding="utf-8")
    data_file = os.environ.get("OPENGLM_COV_DATA")
    if data_file and _cov is None:
        import coverage  # optional: only when per-test coverage is asked for

        source = [s for s in os.environ.get("OPENGLM_COV_SOURCE", "").split(os.pathsep) if s]
        _cov = coverage.Coverage(data_file=data_file, source=source or [str(config.rootdir)],
                                 branch=False, config_file=False)
        _cov.start()
        _wrap_reporters()
        _wrap_unittest_assertions()


def _wrap_reporters() -> None:
    import importlib  # only with coverage: the wrappers switch coverage contexts

    for module_name, name in _REPORTERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, name, None)
        if callable(original):
            setattr(module, name, _reporting(original))


def _context() -> str:
    """The coverage context of the current test's current segment."""
    seg = _current["segment"]
    return _current["nodeid"] + (f"|{seg}" if seg else "")


def _assertion_passed() -> None:
    if _cov is not None and _current["nodeid"] and not _current["depth"]:
        _current["segment"] += 1
        _cov.switch_context(_context())


@pytest.hookimpl(optionalhook=True)
def pytest_assertion_pass(item, lineno, orig, expl):
    _assertion_passed()


def _wrap_unittest_assertions() -> None:
    """unittest's assert* methods: a call that returns (not a context manager such as assertRaises
    without a callable, whose check comes later) is a passing assertion. Assertions calling others
    (assertEqual -> assertListEqual) count once."""
    import unittest  # only with coverage: the wrappers switch coverage contexts

    for name in dir(unittest.TestCase):
        method = getattr(unittest.TestCase, name)
        if name.startswith(("assert", "fail")) and callable(method) and name != "failureException":
            setattr(unittest.TestCase, name, _asserting(method))


def _asserting(fn):
    def wrapper(*args, **kwargs):
        _current["asserting"] += 1
        try:
            result = fn(*args, **kwargs)
        finally:
            _current["asserting"] -= 1
        if not _current["asserting"] and not hasattr(result, "__enter__"):
            _assertion_passed()
        return result

    return wrapper


def _reporting(fn):
    def wrapper(*args, **kwargs):
        outer = _current["depth"] == 0 and _current["nodeid"]
        if outer:
            _cov.switch_context(_current["nodeid"] + REPORT_SUFFIX)
        _current["depth"] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _current["depth"] -= 1
            if outer:
                _cov.switch_context(_context())

    return wrapper


def node_id(nodeid: str) -> str:
    """pytest < 4 names a class's tests `file::Class::()::test`; later ones (and users) `file::Class::test`."""
    return nodeid.replace("::()", "")


def _write(nodeid: str, entry: dict) -> None:
    if _out is not None:
        _out.write(json.dumps({"nodeid": node_id(nodeid), **entry}) + "\n")
        _out.flush()


def pytest_collectreport(report):
    if report.failed:
        _write(report.nodeid or "<collection>", {"outcome": "collect_error", "longrepr": str(report.longrepr)})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.update(nodeid=node_id(item.nodeid), segment=0)
    if _cov is not None:
        _cov.switch_context(_context())
    yield
    _current["nodeid"] = ""
    deadline = float(os.environ.get("OPENGLM_DEADLINE") or 0)
    if deadline and time.time() > deadline:
        item.session.shouldstop = "openglm: the run's time budget is spent"


def _alarm(signum, frame):
    raise TestTimeout("the test ran past OPENGLM_TEST_TIMEOUT")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = float(os.environ.get("OPENGLM_TEST_TIMEOUT") or 0)
    armed = limit > 0 and hasattr(signal, "setitimer")
    if armed:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "longrepr": ""})
    # A test fails if any phase fails; a failing setup/teardown counts as an error.
    if report.failed:
        timed_out = "TestTimeout" in report.longreprtext[-2000:]
        entry["outcome"] = "timeout" if timed_out else "failed" if report.when == "call" else "error"
        entry["longrepr"] += report.longreprtext
    elif report.skipped and report.when in ("setup", "call") and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if report.when == "teardown":
        _write(report.nodeid, entry)


def pytest_sessionfinish(session, exitstatus):
    global _cov, _out
    if _cov is not None:
        _cov.stop()
        _cov.save()
        _cov = None
    if _out is not None:
        _out.close()
        _out = None
