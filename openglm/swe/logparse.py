"""Parse test-runner logs into {test name: status}, the way SWE-bench grades logs.

Statuses are PASSED, FAILED, SKIPPED, ERROR, XFAIL. Two formats are understood:
- pytest run with `-rA`: the short summary lines `PASSED tests/test_x.py::test_y`, and with `-v` the
  lines `tests/test_x.py::test_y PASSED [ 50%]` (pytest before 4.4 has no `-rA` summary; where both
  appear, the summary wins);
- unittest run with `-v`: lines `test_y (pkg.tests.TestX.test_y) ... ok`.
An empty dict means the log could not be parsed (the harness reports it as an infrastructure failure).
"""

from __future__ import annotations

import re

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
_PYTEST_STATUSES = {"PASSED": PASSED, "FAILED": FAILED, "SKIPPED": SKIPPED, "ERROR": ERROR,
                    "XFAIL": XFAIL, "XPASS": PASSED}
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (.+)$")
# A parametrised id may hold spaces: it runs to the first `]` that ends the line or precedes ` - msg`.
_NODE_ID = re.compile(r"^(\S*?\[.*?\])(?=$| - )|^(\S+)")
_UNITTEST_LINE = re.compile(r"^(\w+) \(([\w.]+)\)(?:\n.*?)? \.\.\. (ok|FAIL|ERROR|skipped.*|expected failure"
                            r"|unexpected success)$", re.M)
_UNITTEST_STATUS = {"ok": PASSED, "FAIL": FAILED, "ERROR": ERROR, "expected failure": XFAIL,
                    "unexpected success": FAILED}


_VERBOSE_LINE = re.compile(r"^(\S+?::.+?|\S+\.py) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?$")


def parse_pytest_log(log: str) -> dict[str, str]:
    status: dict[str, str] = {}
    for line in log.splitlines():
        m = _VERBOSE_LINE.match(line.strip())
        if m:  # pytest < 4 puts `::()` between a class and its tests
            status[m.group(1).replace("::()", "")] = _PYTEST_STATUSES[m.group(2)]
    for line in log.splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if not m or m.group(1) == "SKIPPED" and m.group(2).startswith("["):
            continue  # `SKIPPED [1] file:line: reason` names no test
        ident = _NODE_ID.match(m.group(2))
        name = ident and (ident.group(1) or ident.group(2))
        if name and ("::" in name or name.endswith(".py")):  # not unittest's `FAILED (errors=1)`
            status[name] = _PYTEST_STATUSES[m.group(1)]
    return status


def parse_unittest_log(log: str) -> dict[str, str]:
    status: dict[str, str] = {}
    for m in _UNITTEST_LINE.finditer(log):
        method, where, word = m.groups()
        name = f"{method} ({where})"
        status[name] = SKIPPED if word.startswith("skipped") else _UNITTEST_STATUS[word]
    return status


def parse_log(log: str) -> dict[str, str]:
    """Try pytest's format first, then unittest's."""
    return parse_pytest_log(log) or parse_unittest_log(log)


def test_passed(name: str, status: dict[str, str]) -> bool:
    return status.get(name) in (PASSED, XFAIL)


def test_failed(name: str, status: dict[str, str]) -> bool:
    return name not in status or status[name] in (FAILED, ERROR)
