"""The agent's tools: shell, file view/create/edit, search; plus the two control tools
`ask_user` and `submit`, which the step loop handles itself.

`Environment` is what the step loop runs actions in: `call(name, args) -> ToolResult`. `ToolBox` is the
workspace's tools; the run binds it to the task (`loop.RunTools`), and the hook layers' tool wrappers
are Environments around that.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from openglm.agent.tools import files
from openglm.agent.tools.files import PathEscape, ToolError
from openglm.agent.tools.search import search
from openglm.agent.tools.shell import run_shell
from openglm.util.sandbox import Sandbox, SandboxUnavailable

CONTROL_TOOLS = {"ask_user", "submit", "_no_action"}  # answered by the step loop itself, never run
FILE_TOOL_TIMEOUT_S = 60.0  # a file tool still busy after this (a hung filesystem) is abandoned


def _spec(name, description, **params):
    required = [k for k, v in params.items() if not v.pop("optional", False)]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": params, "required": required}}}


TOOL_SPECS = [
    _spec("bash", "Run a bash command in the workspace.", command={"type": "string"}),
    _spec("view", "Show a file with line numbers, or list a directory.", path={"type": "string"},
          start={"type": "integer", "optional": True}, end={"type": "integer", "optional": True}),
    _spec("create", "Create a file with the given content.", path={"type": "string"}, content={"type": "string"},
          overwrite={"type": "boolean", "optional": True}),
    _spec("edit", "Replace the unique occurrence of `old` by `new` in a file.", path={"type": "string"},
          old={"type": "string"}, new={"type": "string"}),
    _spec("search", "Search file contents for a regular expression.", pattern={"type": "string"},
          path={"type": "string", "optional": True}, glob={"type": "string", "optional": True}),
    _spec("ask_user", "Ask the user a question and wait for the answer.", question={"type": "string"}),
    _spec("submit", "Finish the task; the deliverables are checked.", summary={"type": "string"}),
]


@dataclass
class ToolResult:
    output: str
    ok: bool = True
    meta: dict = field(default_factory=dict)


class Environment(Protocol):
    def call(self, name: str, args: dict) -> ToolResult:
        """Run one tool; a mistake of the agent (bad arguments, a path outside the workspace) is a failed
        result, not an exception."""
        ...


@dataclass
class ToolBox:
    """The workspace's tools. `sandbox`: the task's (openglm.util.sandbox); None: every command gets a
    fresh sandbox with the default settings."""

    workspace: str
    sandbox: Sandbox | None = None
    command_timeout: float = 600.0
    max_output: int = 20000
    file_tool_timeout: float = FILE_TOOL_TIMEOUT_S

    def specs(self) -> list[dict]:
        return TOOL_SPECS

    def describe(self) -> dict:
        """How commands are confined (the run_started event records it)."""
        return self.sandbox.describe() if self.sandbox is not None else {"sandbox": "default, one per command"}

    def call(self, name: str, args: dict, timeout: float | None = None, should_stop=lambda: False,
             pidfile=None, output_file=None) -> ToolResult:
        """Run one tool; mistakes (bad args, path escapes) come back as a failed result, not an exception."""
        try:
            if not isinstance(args, dict):
                raise ToolError(f"arguments must be an object, got {args!r}")
            if name == "bash":
                budget = min(self.command_timeout, timeout) if timeout is not None else self.command_timeout
                r = run_shell(args["command"], self.workspace, max(budget, 0.01), self.sandbox, self.max_output,
                              should_stop, pidfile, output_file)
                return ToolResult(r.render(), ok=r.exit_code == 0,
                                  meta={"exit_code": r.exit_code, "killed": r.killed,
                                        "duration_s": round(r.duration_s, 4),
                                        **({"oom_kills": r.oom_kills} if r.oom_kills else {})})
            if name in ("view", "create", "edit", "search"):
                return self._bounded(name, lambda: ToolResult(self._file_tool(name, args)), should_stop)
            raise ToolError(f"unknown tool {name!r} (known: bash, view, create, edit, search, ask_user, submit)")
        except KeyError as e:
            return ToolResult(f"error: missing argument {e} for tool {name}", ok=False)
        except ToolError as e:
            return ToolResult(f"error: {e}", ok=False, meta={"refused": isinstance(e, PathEscape)})
        except SandboxUnavailable as e:
            return ToolResult(f"error: {e}", ok=False, meta={"refused": True, "sandbox": "unavailable"})
        except (OSError, UnicodeDecodeError) as e:
            if getattr(e, "errno", None) == 28:  # ENOSPC: let the runtime pause the task
                raise
            return ToolResult(f"error: {e}", ok=False)

    def _file_tool(self, name: str, args: dict) -> str:
        if name == "view":
            return files.view(self.workspace, args.get("path", "."), args.get("start"), args.get("end"),
                              self.max_output)
        if name == "create":
            return files.create(self.workspace, args["path"], args["content"], bool(args.get("overwrite", False)))
        if name == "edit":
            return files.edit(self.workspace, args["path"], args["old"], args["new"])
        return search(self.workspace, args["pattern"], args.get("path", "."), args.get("glob"), self.max_output)

    def _bounded(self, name: str, run, should_stop) -> ToolResult:
        """`run()` in a thread of its own, given up on at a cancel or after `file_tool_timeout`: a read the
        kernel never answers (a hung mount) then holds that thread, not the task."""
        box: dict = {}

        def target():
            try:
                box["result"] = run()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which sorts it
                box["error"] = e

        thread = threading.Thread(target=target, daemon=True, name=f"tool-{name}")
        thread.start()
        deadline = time.monotonic() + self.file_tool_timeout
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive() and should_stop():
                return ToolResult(f"error: {name} was cancelled", ok=False, meta={"killed": "cancelled"})
            if thread.is_alive() and time.monotonic() > deadline:
                return ToolResult(f"error: {name} did not finish within {self.file_tool_timeout:g} s; abandoned",
                                  ok=False, meta={"killed": "timeout"})
        if "error" in box:
            raise box["error"]
        return box["result"]


__all__ = ["CONTROL_TOOLS", "Environment", "PathEscape", "Sandbox", "ToolBox", "ToolError", "ToolResult",
           "TOOL_SPECS"]
