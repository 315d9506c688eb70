"""Constrained decoding: a per-sequence grammar masks the logits of that sequence's next token.

The grammar engine is llguidance (vLLM's "guidance" structured-output backend; Rust, CPU, no torch
dependency). A request's `SamplingParams.grammar` is an llguidance grammar (Lark with `%json`
schemas, built by the server from `tools`/`response_format`); the sequence gets its own matcher,
every step its allowed-token bitmask is applied to its own logits row only (the other rows of the
continuous batch are untouched), and each sampled token advances the matcher. When the grammar is
complete the mask allows only the stop tokens, so the sequence ends at a stop token.

The masks are computed in the engine's thread, after the forward: computing them in a worker thread
while the model runs (as vLLM overlaps them with the GPU) was measured on the shared 2-core machine and
made steps slower whenever the second core was busy (the worker waited for a core and the GIL).

A grammar is compiled once (`compile`, which llguidance runs without the GIL, so the server calls it from a
thread, never the engine's) and kept in a small cache: each sequence of a request (its `n` choices, and later
requests with the same constraint) gets a cheap copy of the compiled matcher, with its first mask computed
already. llguidance's parser limits bound the work of each mask; its errors stay terse (no parser state, no
grammar excerpt, no backtrace). How long a grammar may take to compile is the server's budget: it checks a
new grammar in a worker process it can kill (`server/prepare.py`).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from openglm.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

MAX_ERROR_CHARS = 400
CACHE_SIZE = 32  # compiled grammars kept (agents resend the same tools and schemas turn after turn)


class GrammarError(ValueError):
    """A grammar that llguidance cannot compile (the request's fault: a 400 in the server)."""


def one_line(message: str) -> str:
    """llguidance's error as one line: its reason, without the grammar excerpt (numbered source lines and
    carets) or a backtrace that follow it."""
    kept = []
    for line in message.splitlines():
        text = line.strip()
        if re.match(r"\d+ \|", text) or text.lower().startswith(("stack backtrace", "backtrace")):
            break
        if text and set(text) != {"^"}:
            kept.append(text)
    out = re.sub(r"^at \d+\(\d+\): ", "", " ".join(kept)) or "unknown error"
    return out if len(out) <= MAX_ERROR_CHARS else out[: MAX_ERROR_CHARS - 3] + "..."


class GrammarEngine:
    """The llguidance view of one tokenizer + vocabulary; builds a matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance  # the grammar engine: loaded only when a request is constrained

        self._llg = llguidance
        # the stop tokens are the grammar's "eos": a finished grammar may only stop the turn
        self.lltok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size,
                                            eos_token=tokenizer.stop_ids or None)
        self.vocab_size = vocab_size
        self.compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> compiled matcher (first mask done)
        self._lock = threading.Lock()

    def limits(self):
        """llguidance's per-mask work limits (its defaults), with terse errors: no parser state in a message."""
        return self._llg.LLParserLimits(verbose_errors=False)

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming the problem when `grammar` does not compile."""
        try:
            is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok,
                                                                                    limits=self.limits())
        except BaseException as exc:  # noqa: BLE001 - a Rust panic surfaces as a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(f"the output constraint does not compile: {one_line(str(exc))}") from None
        if is_error:
            raise GrammarError(f"the output constraint does not compile: {one_line(messages[0] if messages else '')}")

    def compile(self, grammar: str):
        """The compiled matcher of `grammar` (from the cache, or compiled now: any thread may call this)."""
        with self._lock:
            if grammar in self.compiled:
                self.compiled.move_to_end(grammar)
                return self.compiled[grammar]
        try:
            m = self._llg.LLMatcher(self.lltok, grammar, log_level=0, limits=self.limits())
        except BaseException as exc:  # noqa: BLE001 - a Rust panic surfaces as a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(f"the output constraint does not compile: {one_line(str(exc))}") from None
        if m.is_error():
            raise GrammarError(f"the output constraint does not compile: {one_line(m.get_error())}")
        words = (self.vocab_size + 31) // 32
        first = np.empty(words, dtype=np.int32)  # the first mask: its lexer work is done once, not per sequence
        m.unsafe_compute_mask_ptr(first.ctypes.data, words * 4)
        if m.is_error():  # over a parser limit at the very first token: it could never generate
            raise GrammarError(f"the output constraint cannot be used: {one_line(m.get_error())}")
        with self._lock:
            self.compiled[grammar] = m
            while len(self.compiled) > CACHE_SIZE:
                self.compiled.popitem(last=False)
        return m

    def matcher(self, grammar: str):
        """A sequence's own matcher: a copy of the compiled one."""
        return self.compile(grammar).deep_copy()

    def apply_masks(self, logits: "torch.Tensor", seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of `logits` whose sequence has a grammar (others are untouched)."""
        import torch  # with the engine's logits (the server's prepare workers import this module without it)

        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        packed = np.full((len(seqs), words), -1, dtype=np.int32)  # all bits set: every token allowed
        base, stride = packed.ctypes.data, words * 4
        for i in rows:  # llguidance writes each mask straight into its row of the array
            seqs[i].matcher.unsafe_compute_mask_ptr(base + i * stride, stride)
        # bit k of word w is token 32 * w + k (little-endian bytes, least significant bit first); inverted
        # before unpacking, so a set bit is a banned token and the unpacked bytes read as a bool mask
        n = min(logits.shape[-1], 32 * words)
        banned = np.unpackbits(np.invert(packed).view(np.uint8), axis=1, bitorder="little")[:, :n].view(np.bool_)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
                and not logits.requires_grad:
            np.copyto(logits.numpy()[:, :n], -np.inf, where=banned)  # a third of masked_fill_'s time at batch 8
        else:
            logits[:, :n].masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))

    @staticmethod
    def advance(seq: Sequence, token: int) -> bool:
        """Feed the sampled token to the sequence's matcher; True when the grammar says stop."""
        m = seq.matcher
        ok = m.consume_token(token)
        return (not ok) or m.is_stopped() or m.is_error()
