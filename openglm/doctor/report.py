"""What `openglm doctor` reports: one `Check` per thing it looked at (ok, info, warn or error), each problem with
its fix; a `Report` prints them for people or as JSON."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field

LEVELS = ("ok", "info", "warn", "error")
PROBLEMS = ("warn", "error")


@dataclass
class Check:
    id: str  # "area.name" (machine.compiler, run.expert_load, ...): stable, for scripts and tests
    level: str  # one of LEVELS
    message: str  # what was found, with the figures
    fix: str = ""  # what to do about it (problems only)
    data: dict = field(default_factory=dict)  # the figures, for --json

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]


def ok(check_id: str, message: str, **data) -> Check:
    return Check(check_id, "ok", message, data=data)


def info(check_id: str, message: str, fix: str = "", **data) -> Check:
    return Check(check_id, "info", message, fix, data)


def warn(check_id: str, message: str, fix: str, **data) -> Check:
    return Check(check_id, "warn", message, fix, data)


def error(check_id: str, message: str, fix: str, **data) -> Check:
    return Check(check_id, "error", message, fix, data)


@dataclass
class Report:
    target: dict  # {"kind": "machine" | "checkpoint" | "run" | "server", "path" or "url": ...}
    checks: list[Check]

    def problems(self, level: str | None = None) -> list[Check]:
        return [c for c in self.checks if c.level in PROBLEMS and (level is None or c.level == level)]

    def exit_code(self) -> int:
        """1 when something would fail (an error), else 0: warnings are advice."""
        return 1 if self.problems("error") else 0

    def to_dict(self) -> dict:
        counts = {level: sum(c.level == level for c in self.checks) for level in LEVELS}
        return {"target": self.target, "checks": [asdict(c) for c in self.checks], "counts": counts}

    def text(self, width: int = 110) -> str:
        what = self.target.get("path") or self.target.get("url") or "this machine"
        lines = [f"openglm doctor: {self.target['kind']} {what}" if what != "this machine" else
                 "openglm doctor: this machine"]
        area = None
        for c in self.checks:
            if c.area != area:
                area = c.area
                lines.append(area)
            lines += _wrap(f"  {c.level:<6}", c.message, width)
            if c.fix and c.level in PROBLEMS:
                lines += _wrap("        fix: ", c.fix, width)
        errors, warnings = len(self.problems("error")), len(self.problems("warn"))
        lines.append("no problems found" if not errors + warnings else
                     f"{errors} error(s), {warnings} warning(s)")
        return "\n".join(lines)


def _wrap(head: str, text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False) or [head]
