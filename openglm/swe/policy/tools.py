"""The policy's phase tools: specs offered to the model, and their translation into shell
commands running `openglm.swe.policy.checks` (so they go through the step protocol)."""

from __future__ import annotations

import json
import shlex

from openglm.agent.llm.base import ToolCall


def _spec(name, description, properties, required):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_STR, _LIST = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
PHASE_DONE = _spec("phase_done", "Finish the current phase.",
                   {"summary": _STR, "failing_tests": _LIST}, ["summary"])
LOCALIZE = _spec("localize", "Rank suspicious files/functions/lines (traceback, coverage SBFL, text).",
                 {"failing_tests": _LIST, "issue": _STR}, ["failing_tests"])
SEARCH_CODE = _spec("search_code", "Search the code base (identifiers or a description): best chunks as "
                    "path:start-end and name; uses the repo's code index when built, else BM25.",
                    {"query": _STR, "k": {"type": "integer"}}, ["query"])
BISECT = _spec("bisect", "git bisect run: first bad commit between `good` and HEAD.",
               {"good": _STR, "command": _STR}, ["good", "command"])
REGRESSION = _spec("regression_test", "Write a regression test file and run the test; it must fail now.",
                   {"path": _STR, "content": _STR, "test": {"type": "string",
                                                             "description": "pytest node id"}},
                   ["path", "content", "test"])
CANDIDATES = _spec("propose_candidates", "Propose alternative patches (unified diffs) to be scored.",
                   {"candidates": {"type": "array", "items": {"type": "object", "properties": {
                       "summary": _STR, "patch": _STR}, "required": ["patch"]}}}, ["candidates"])
RUN_SUITE = _spec("run_suite", "Run the whole test suite.", {}, [])

PHASE_TOOLS = {
    "environment": [PHASE_DONE],
    "diagnosis": [LOCALIZE, SEARCH_CODE, BISECT, PHASE_DONE],
    "design": [REGRESSION, CANDIDATES],
    "verification": [RUN_SUITE],
}
CHECKS = {"localize": "localize", "search_code": "search", "bisect": "bisect", "regression_test": "regress",
          "propose_candidates": "score", "run_suite": "suite"}


def check_call(python: str, check: str, request: dict, call_id: str = "") -> ToolCall:
    """A bash call running one check with its JSON request on stdin (a quoted heredoc: no expansion)."""
    body = json.dumps(request)
    marker = "OPENGLM_REQUEST_END"
    command = f"{shlex.quote(python)} -m openglm.swe.policy.checks {check} <<'{marker}'\n{body}\n{marker}"
    return ToolCall(name="bash", arguments={"command": command}, id=call_id)


def echo_call(text: str, call_id: str = "", ok: bool = True) -> ToolCall:
    """A call whose observation is a message from the policy (a refusal or a phase note)."""
    return ToolCall(name="bash", arguments={"command": f"printf '%s\\n' {shlex.quote(text)}"
                                            + ("" if ok else "; exit 1")}, id=call_id)


def parse_check(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith("OPENGLM-CHECK "):
            try:
                return json.loads(line[len("OPENGLM-CHECK "):])
            except json.JSONDecodeError:
                return None
    return None
