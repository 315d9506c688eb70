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
"""

from __future__ import annotations

import re

import numpy as np
import torch

from openglm.engine.sequence import Sequence




MAX_ERROR_CHARS = 400


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

    def check(self, grammar: str) -> None:
        """Raise GrammarError naming the problem when `grammar` does not compile."""
        try:
            is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        except BaseException as exc:  # noqa: BLE001 - a Rust panic surfaces as a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(f"the output constraint does not compile: {one_line(str(exc))}") from None
        if is_error:
            raise GrammarError(f"the output constraint does not compile: {one_line(messages[0] if messages else '')}")

    def matcher(self, grammar: str):
        m = self._llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the output constraint does not compile: {one_line(m.get_error())}")
        return m

    def apply_masks(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of `logits` whose sequence has a grammar (others are untouched)."""
        rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        packed = np.empty((len(seqs), words), dtype=np.int32)
        packed.fill(-1)  # all bits set: every token allowed (the unconstrained rows)
        for i in rows:  # llguidance writes each mask straight into its row of the array
            seqs[i].matcher.unsafe_compute_mask_ptr(packed[i].ctypes.data, words * 4)
        # bit k of word w is token 32 * w + k (little-endian bytes, least significant bit first)
        allowed = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        logits[:, : allowed.shape[1]].masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))

    @staticmethod
    def advance(seq: Sequence, token: int) -> bool:
        """Feed the sampled token to the sequence's matcher; True when the grammar says stop."""
        m = seq.matcher
        ok = m.consume_token(token)
        return (not ok) or m.is_stopped() or m.is_error()
