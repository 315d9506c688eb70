"""The replay model: scripted assistant turns from a JSONL file, for tests and demos.

Each line is one turn: {"content": "...", "tool_calls": [{"name": "bash", "arguments": {...}}]}, optionally
with "finish_reason" ("length": a reply cut off by max_tokens) and "truncation" (what cut it).
The turn served is chosen by how many assistant messages the conversation already holds, so the
model is stateless: a resumed run asks for exactly the turn it needs. `calls_log` (optional) gets
one line per call ("turn unix_time"), which lets the kill test prove no recorded call was paid
for twice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from openglm.agent.llm.base import Model, ModelError, ModelResponse, ToolCall, estimate_tokens


def load_turns(path: str | Path) -> list[dict]:
    turns = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                turns.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON: {e}") from None
    return turns


class ReplayModel(Model):
    def __init__(self, turns: list[dict] | str | Path, calls_log: str | None = None, name: str = "replay"):
        self.turns = load_turns(turns) if isinstance(turns, (str, Path)) else list(turns)
        self.calls_log = calls_log
        self.name = name

    def query(self, messages, tools=None) -> ModelResponse:
        index = sum(1 for m in messages if m.get("role") == "assistant")
        if self.calls_log:
            with open(self.calls_log, "a") as f:
                f.write(f"{index} {time.time():.6f}\n")
                f.flush()
                os.fsync(f.fileno())
        if index >= len(self.turns):
            raise ModelError(f"replay script exhausted after {len(self.turns)} turns")
        turn = self.turns[index]
        calls = [ToolCall(name=c["name"], arguments=c.get("arguments", {}), id=c.get("id", f"call_{index}_{j}"))
                 for j, c in enumerate(turn.get("tool_calls", []))]
        content = turn.get("content", "")
        return ModelResponse(content=content, tool_calls=calls, prompt_tokens=estimate_tokens(messages),
                             completion_tokens=estimate_tokens([{"content": content,
                                                                 "tool_calls": turn.get("tool_calls")}]),
                             model=self.name, finish_reason=turn.get("finish_reason", ""),
                             truncation=turn.get("truncation", ""))
