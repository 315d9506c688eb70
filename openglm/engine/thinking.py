"""The thinking budget: after `SamplingParams.thinking_budget` reasoning tokens, the next token is `</think>`.

A GLM model reasons between `<think>` and `</think>`. The reasoning is open from the first output token
when the prompt opened it (`thinking_open`, GLM-4.7/5 templates end the prompt `<think>`); otherwise it
opens where the model writes `<think>` before anything but whitespace (GLM-4.5/4.6 templates leave that
to the model). It ends at `</think>` or at one of `think_end_ids` (a `<tool_call>`: the output parser reads
a call written before `</think>` as the end of the reasoning, so a call is never cut by a forced
`</think>`). Once a sequence has written `thinking_budget` tokens of open reasoning, its row may only
sample `</think>` (the answer, and a grammar's structure after it, then always get the rest of
`max_tokens`). Where the row's grammar does not allow `</think>` yet (a byte-level token split a
character the reasoning's regex must finish first), the force waits for the next step.

Each sequence's state is updated from the tokens appended since the previous step, so the cost is one
look per new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openglm.engine.sequence import Sequence


@dataclass
class ReasoningState:
    start: int | None  # output index of the first reasoning token (None: not open yet)
    closed: bool = False  # the reasoning ended, or (model-opened) can no longer open
    seen: int = 0  # output tokens looked at


class ThinkingBudget:
    def __init__(self, decode):
        self.decode = decode  # token ids -> text: is what came before a model-written <think> whitespace?

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place: rows whose reasoning has used its budget keep only `</think>`."""
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.thinking_budget is None:
                continue
            state = self._state(seq)
            if state.closed or state.start is None or seq.num_output_tokens - state.start < p.thinking_budget:
                continue
            end = p.think_ids[1]
            if end >= logits.shape[-1] or logits[row, end] == float("-inf"):
                continue  # the grammar does not allow it yet
            kept = logits[row, end].clone()
            logits[row].fill_(float("-inf"))
            logits[row, end] = kept

    def _state(self, seq: Sequence) -> ReasoningState:
        p, out = seq.params, seq.output_token_ids
        state = seq.reasoning
        if state is None:
            state = seq.reasoning = ReasoningState(0 if p.thinking_open else None)
        open_id, close_id = p.think_ids
        for k in range(state.seen, len(out)):
            if state.closed:
                break
            token = out[k]
            if state.start is not None:
                state.closed = token == close_id or token in p.think_end_ids
            elif token == open_id and not self.decode(out[:k]).strip():
                state.start = k + 1
            elif self.decode([token]).strip():
                state.closed = True  # the answer began without reasoning
        state.seen = len(out)
        return state
