"""The plan: a tree of goals, kept in the task's log with the guard's state; the ladder's L4 rebuilds
it around a failure, from the subgoals the model answers with."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

OPEN, DONE, FAILED, DROPPED = "open", "done", "failed", "dropped"


@dataclass
class Goal:
    id: str
    text: str
    status: str = OPEN
    note: str = ""
    children: list["Goal"] = field(default_factory=list)


class GoalTree:
    def __init__(self, objective: str, root: Goal | None = None, revision: int = 0):
        self.root = root or Goal("g0", objective)
        self.revision = revision  # how many times the plan was rebuilt

    def walk(self):
        stack = [self.root]
        while stack:
            goal = stack.pop()
            yield goal
            stack.extend(reversed(goal.children))

    def find(self, goal_id: str) -> Goal:
        for goal in self.walk():
            if goal.id == goal_id:
                return goal
        raise KeyError(f"no goal {goal_id!r} in the plan")

    def add(self, parent_id: str, text: str) -> Goal:
        parent = self.find(parent_id)
        goal = Goal(f"{parent.id}.{len(parent.children) + 1}", text)
        parent.children.append(goal)
        return goal

    def current(self) -> Goal:
        """The first open leaf (depth first): what the agent is working on."""
        for goal in self.walk():
            if goal.status == OPEN and not any(c.status == OPEN for c in goal.children):
                return goal
        return self.root

    def mark(self, goal_id: str, status: str, note: str = ""):
        goal = self.find(goal_id)
        goal.status, goal.note = status, note or goal.note

    def replan(self, failure: str, subgoals: list[str]) -> Goal:
        """Fail the current goal with the failure as its note; the open siblings are dropped and the
        new subgoals take their place under the same parent (a new approach to the same end)."""
        failed = self.current()
        parent = self._parent(failed) or self.root
        if failed is self.root:  # no subgoals yet: the failed attempt is kept as one, for the record
            parent.children.append(Goal(f"g0.{len(parent.children) + 1}", "first approach", FAILED, failure[:500]))
        else:
            failed.status, failed.note = FAILED, failure[:500]
        for sibling in parent.children:
            if sibling.status == OPEN:
                sibling.status = DROPPED
        self.revision += 1
        for text in subgoals:
            goal = Goal(f"{parent.id}.r{self.revision}.{len(parent.children) + 1}", text)
            parent.children.append(goal)
        return parent

    def _parent(self, child: Goal) -> Goal | None:
        for goal in self.walk():
            if any(c is child for c in goal.children):
                return goal
        return None

    def render(self) -> str:
        lines = []

        def visit(goal: Goal, depth: int):
            note = f" ({goal.note})" if goal.note else ""
            lines.append(f"{'  ' * depth}- [{goal.status}] {goal.text}{note}")
            for child in goal.children:
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"revision": self.revision, "root": asdict(self.root)}

    @classmethod
    def from_dict(cls, data: dict) -> "GoalTree":
        def build(d: dict) -> Goal:
            return Goal(d["id"], d["text"], d.get("status", OPEN), d.get("note", ""),
                        [build(c) for c in d.get("children", [])])

        root = build(data["root"])
        return cls(root.text, root, int(data.get("revision", 0)))


def parse_plan(text: str) -> list[str]:
    """Subgoals from a model's answer: the lines that start with '-', '*' or 'N.'/'N)'."""
    items = [m.group(1).strip() for m in re.finditer(r"^\s*(?:[-*]|\d+[.)])\s+(.+)$", text, re.M)]
    return [i for i in items if i]
