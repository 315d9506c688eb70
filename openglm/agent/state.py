"""Agent state rebuilt from the event log: the log is the only source of truth.

A run never keeps state that the log does not have: on resume the worker replays the log to
get the conversation, the last committed step and snapshot, the policy's phase, and the
write-ahead model response of a step that had not committed (that step is redone without a new
model call). `AgentState.apply` is the one place that says what an event does: the live run applies
each event as it logs it, `rebuild` applies the log, so the two states cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openglm.agent.llm.base import ModelResponse
from openglm.agent.store.base import Event

CONDENSED_CHARS = 200


@dataclass
class Block:
    step: int
    messages: list[dict]


@dataclass
class AgentState:
    initial: list[dict] = field(default_factory=list)  # system + objective
    blocks: list[Block] = field(default_factory=list)
    step: int = -1  # last committed step (-1: not even the initial snapshot)
    last_step: int = -1  # highest step number ever committed (steps stay unique after a rollback)
    snapshot: str = ""  # the committed snapshot the workspace must equal
    pending: ModelResponse | None = None  # write-ahead response of step `last_step + 1`
    observations: dict[int, list[dict]] = field(default_factory=dict)  # of steps not committed yet
    phase: str = ""
    phase_data: dict = field(default_factory=dict)
    condensed_upto: int = -1
    condensed_steps: set[int] = field(default_factory=set)  # looping steps (stuck detection) whose output is dropped
    steps: dict[int, str] = field(default_factory=dict)  # step -> snapshot id (kept history only)

    @property
    def next_step(self) -> int:
        return self.last_step + 1

    def messages(self) -> list[dict]:
        out = [dict(m) for m in self.initial]
        for b in self.blocks:
            for m in b.messages:
                if b.step in self.condensed_steps and m.get("observation"):
                    m = {**m, "content": "[condensed: a repeat of an earlier step; output dropped]"}
                elif b.step <= self.condensed_upto and m.get("observation"):
                    m = {**m, "content": _condense(m["content"])}
                out.append({k: v for k, v in m.items() if k != "observation"})
        return out

    def apply(self, kind: str, step: int, data: dict) -> None:
        """What the event (kind, step, data) does to the state; events that change nothing are ignored."""
        if kind == "model_response":  # write-ahead: the step's answer, until the step commits
            self.pending = ModelResponse.from_dict(data["response"])
        elif kind == "observation":
            self.observations.setdefault(step, []).append(data)
        elif kind == "step_committed":
            response = self.pending if step > 0 else None
            self.add_step(step, response, self.observations.pop(step, []), data["snapshot"])
        elif kind == "rollback":
            self.rollback(data["to_step"], data["snapshot"])
        elif kind == "answer":
            answer = {"role": "user", "content": f"Answer from the user: {data['answer']}"}
            self.blocks.append(Block(self.step, [answer]))
        elif kind == "phase":
            self.phase, self.phase_data = data["phase"], data.get("data", {})
        elif kind == "guidance":  # a message to the model from a layer above the loop (recovery ladder)
            self.blocks.append(Block(self.step, [{"role": "user", "content": data["content"]}]))
        elif kind == "pending_discarded":  # a fault paused the step: ask the model again, do not replay it
            self.pending = None
        elif kind == "loop_condensed":
            self.condensed_steps.update(data["steps"])
        elif kind == "condensation":
            self.condensed_upto = max(self.condensed_upto, data["upto_step"])

    def add_step(self, step: int, response: ModelResponse | None, observations: list[dict], snapshot: str):
        """A committed step: its assistant turn and observations join the conversation."""
        msgs = [response.to_message()] if response is not None else []
        # OpenAI's order: the assistant's tool calls, then one tool reply per call (in call order), and
        # only then any user message (observations of calls the model did not make)
        call_ids = [c.id for c in response.tool_calls] if response is not None else []
        replies = {o["call_id"]: o for o in observations if o.get("call_id") in call_ids and not o.get("as_user")}
        for cid in call_ids:
            output = replies[cid]["output"] if cid in replies else "[no result: the call was not run]"
            msgs.append({"role": "tool", "tool_call_id": cid, "content": output, "observation": True})
        for o in observations:
            if o.get("call_id") not in replies:
                msgs.append({"role": "user", "content": f"Observation ({o['name']}):\n{o['output']}",
                             "observation": True})
        if msgs:
            self.blocks.append(Block(step, msgs))
        self.step, self.last_step, self.snapshot, self.pending = step, max(self.last_step, step), snapshot, None
        self.steps[step] = snapshot

    def rollback(self, to_step: int, snapshot: str):
        self.blocks = [b for b in self.blocks if b.step <= to_step]
        self.steps = {s: sha for s, sha in self.steps.items() if s <= to_step}
        self.blocks.append(Block(to_step, [{"role": "user", "content": f"The workspace was rolled back to its state "
                                            f"after step {to_step}; later changes are gone."}]))
        self.step, self.snapshot, self.pending = to_step, snapshot, None


def _condense(text: str) -> str:
    if len(text) <= CONDENSED_CHARS:
        return text
    dropped = len(text) - CONDENSED_CHARS
    return text[:CONDENSED_CHARS] + f"\n[... condensed: {dropped} characters of an old observation dropped]"


def rebuild(initial: list[dict], events: list[Event], before=None) -> AgentState:
    """Replay the log into an AgentState. `before(event, state)`, if given, sees the state as it was
    just before each event (the trajectory viewer reads each turn's prompt this way)."""
    st = AgentState(initial=initial)
    for e in events:
        if before is not None:
            before(e, st)
        st.apply(e.kind, e.step, e.data)
    return st
