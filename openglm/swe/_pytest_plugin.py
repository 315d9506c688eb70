"""A pytest plugin (loaded with `-p openglm.swe._pytest_plugin`) that records, per test node id,
the outcome, the failure text and - when asked - the lines it executed.

Why a plugin rather than parsing pytest's console output: node ids, outcomes and per-test coverage
contexts come straight from pytest's hooks, so parametrised tests, unittest classes and odd names
need no parsing. Environment variables (set by `openglm.swe.testrun`):
  OPENGLM_RESULTS  path of the JSON file to write ({nodeid: {"outcome", "longrepr"}})
  OPENGLM_COV_DATA path of a coverage data file; when set, coverage contexts are named by node id
  OPENGLM_COV_SOURCE os.pathsep-separated source dirs to measure (default: the rootdir)
"""

from __future__ import annotations

import json
import os

import pytest

from openglm.util.files import write_atomic

_results: dict[str, dict] = {}
_cov = None


def pytest_configure(config):
    global _cov
    data_file = os.environ.get("OPENGLM_COV_DATA")
    if data_file and _cov is None:
        import coverage  # optional: only when per-test coverage is asked for

        source = [s for s in os.environ.get("OPENGLM_COV_SOURCE", "").split(os.pathsep) if s]
        _cov = coverage.Coverage(data_file=data_file, source=source or [str(config.rootpath)],
                                 branch=False, config_file=False)
        _cov.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _cov is not None:
        _cov.switch_context(item.nodeid)
    yield


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "longrepr": ""})
    # A test fails if any phase fails; a failing setup/teardown counts as an error.
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["longrepr"] += report.longreprtext
    elif report.skipped and report.when in ("setup", "call") and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    global _cov
    if _cov is not None:
        _cov.stop()
        _cov.save()
        _cov = None
    path = os.environ.get("OPENGLM_RESULTS")
    if path:
        write_atomic(path, json.dumps(_results))
