"""The last phase of a step: what each row's sampled tokens do to its sequence, and what is reported.

`Postprocessor` keeps the KV each row computed (its full blocks join the prefix cache), appends the new
tokens one at a time through the stop conditions (stop token ids, EOS, a completed grammar, stop strings,
max_tokens, the context), detokenizes, and finishes the sequences that stopped. `request_output` turns a
request's sequences into the `RequestOutput` the caller sees.

Every step costs what it added, not what the sequence holds (a 100k-token output is reported as cheaply
as a short one): text is detokenized incrementally (each decode covers the new tokens and the previous
decode's tokens as context, vLLM's scheme: exact for byte-level BPE, including multi-byte characters split
across tokens), a stop string is looked for only where it could newly end, and an output carries only what
is new since the previous one (the whole output once, when the sequence finishes). While a sequence runs,
the tail that could still grow into a stop string, and a trailing incomplete UTF-8 character, are held
back from the reported text, so reported text is never taken back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from openglm.engine.grammar import GrammarEngine
from openglm.engine.outputs import CompletionOutput, RequestOutput
from openglm.engine.scheduler import Scheduler
from openglm.engine.sequence import Sequence

REPLACEMENT = "\ufffd"


@dataclass
class RowResult:
    """What the run phase produced for one scheduled sequence (nothing about the sequence has changed yet)."""

    seq: Sequence
    computed: int  # tokens whose KV this step keeps (the scheduled count, fewer when drafts were rejected)
    tokens: list[int]  # the new tokens, in order (none for a prefill chunk that does not reach the end)
    logprobs: list[dict | None]  # one per token (None where the request asked for none)
    hidden: torch.Tensor | None = None  # speculative decoding: the final-norm hidden states, the MTP layer's input


class Postprocessor:
    def __init__(self, scheduler: Scheduler, tokenizer, max_model_len: int, counters: dict[str, int]):
        self.scheduler, self.block_manager = scheduler, scheduler.block_manager
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.eos_ids = set(getattr(tokenizer, "eos_ids", []) or [])
        self.max_model_len = max_model_len
        self.counters = counters  # the engine's: prompt_tokens and generation_tokens are counted here

    def __call__(self, results: list[RowResult]) -> dict[str, str]:
        """Apply a step's results; returns {request id: why} for the requests whose tokens could not be applied."""
        for r in results:
            r.seq.num_computed_tokens += r.computed  # a rejected draft's KV lies past this: overwritten later
            r.seq.set_drafts([])
            self.block_manager.commit(r.seq)
        failed = {}
        for r in results:
            for token, logprob in zip(r.tokens, r.logprobs):
                if r.seq.is_finished:  # e.g. a stop token inside a run of accepted drafts
                    break
                try:
                    self.append(r.seq, token, logprob)
                except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request fails, alone
                    failed[r.seq.request_id] = f"{type(exc).__name__}: {exc}"
                    break
        return failed

    def append(self, seq: Sequence, token: int, logprob: dict | None) -> None:
        if seq.num_output_tokens == 0:
            self.counters["prompt_tokens"] += seq.num_prompt_tokens
        seq.append_token(token)
        self.counters["generation_tokens"] += 1
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self.stop_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why the sequence ends after `token` ("stop" or "length"), or None. It also advances the grammar and
        refreshes the text, so it runs for every token even when an earlier check already said stop."""
        p = seq.params
        reason = None
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif may_stop and token in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        if seq.matcher is not None and GrammarEngine.advance(seq, token) and reason is None:
            reason = "stop"  # the grammar is complete (or, never expected, rejected the token)
        if self.decode is not None and update_text(seq, self.decode) and reason is None:
            reason = "stop"
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        return reason


def new_text(seq: Sequence, decode, final: bool = False) -> str:
    """The text the output tokens not yet in `seq.output_text` add: "" while they end inside a UTF-8 character
    (unless `final`). Decodes only those tokens and the previous decode's, whatever the sequence holds."""
    ids, base = seq.token_ids, seq.num_prompt_tokens
    if base + seq.decoded_upto == len(ids):
        return ""
    context = decode(ids[base + seq.decoded_from: base + seq.decoded_upto])
    text = decode(ids[base + seq.decoded_from:])
    if text.endswith(REPLACEMENT) and not final:
        return ""  # an incomplete character: wait for its next bytes
    seq.decoded_from, seq.decoded_upto = seq.decoded_upto, len(ids) - base
    return text[len(context):]


def update_text(seq: Sequence, decode, final: bool = False) -> bool:
    """Extend `seq.output_text` by the new tokens' text; return True when a stop string ended the sequence."""
    new = new_text(seq, decode, final)
    if not new:
        return False
    text, seq.output_text = seq.output_text, ""  # one reference: `+=` extends the string in place
    before = len(text)
    text += new
    seq.output_text = text
    p = seq.params
    if p.stop:  # a stop string can only newly end in the added text
        start = max(0, before - max(map(len, p.stop)) + 1)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in p.stop) if i >= 0]
        if hits:
            i, s = min(hits)
            seq.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
            seq.stop_reason = s
            return True
    return False


def streamable_length(seq: Sequence) -> int:
    """How many characters of `seq.output_text` can be reported without ever being taken back."""
    n = len(seq.output_text)
    if not seq.is_finished and seq.params.stop:
        n -= max(map(len, seq.params.stop)) - 1
    return max(n, seq.reported_chars)


def choice_output(seq: Sequence, whole: bool, decode=None) -> CompletionOutput:
    """What is new in `seq` since its previous output (and with `whole`, all of it); advances the sequence's
    reported position."""
    if seq.is_finished and decode is not None and not isinstance(seq.stop_reason, str):
        update_text(seq, decode, final=True)  # an incomplete character at the very end: as the bytes decode
    upto, tokens = streamable_length(seq), seq.num_output_tokens
    keep_logprobs = seq.params.logprobs is not None
    out = CompletionOutput(index=seq.index, text=None, token_ids=None, finish_reason=seq.finish_reason,
                           stop_reason=seq.stop_reason, delta_text=seq.output_text[seq.reported_chars: upto],
                           delta_token_ids=seq.token_ids[seq.num_prompt_tokens + seq.reported_tokens:],
                           delta_logprobs=seq.logprobs[seq.reported_tokens:] if keep_logprobs else None,
                           text_offset=seq.reported_chars)
    seq.reported_chars, seq.reported_tokens = upto, tokens
    if whole:
        out.text, out.token_ids = seq.output_text, seq.output_token_ids
        out.logprobs = list(seq.logprobs) if keep_logprobs else None
    return out


def request_output(request_id: str, seqs: list[Sequence], error: str | None = None, decode=None) -> RequestOutput:
    """What is new in the request's choices, and once all are finished the whole of each (safe to hand to another
    thread: nothing in it changes later)."""
    finished = all(s.is_finished for s in seqs)
    outs = [choice_output(s, finished, decode) for s in seqs]
    first = [s.first_token_time for s in seqs if s.first_token_time is not None]
    return RequestOutput(request_id, seqs[0].prompt_token_ids, outs, finished,
                         num_cached_tokens=seqs[0].num_cached_prompt_tokens,
                         metrics={"arrival_time": seqs[0].arrival_time,
                                  "first_token_time": min(first) if first else None,
                                  "finished_time": time.monotonic() if finished else None}, error=error)
