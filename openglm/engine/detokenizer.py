"""Output text of a sequence: detokenize, cut at stop strings, and decide how much is safe to stream.

Text is re-decoded from all output tokens (cheap at these lengths, and exact for byte-level BPE).
While a sequence runs, the tail that could still grow into a stop string, and any trailing
incomplete UTF-8 character, are held back from the stream.
"""

from __future__ import annotations

from openglm.engine.sequence import Sequence

REPLACEMENT = "\ufffd"


def update_text(seq: Sequence, decode) -> bool:
    """Refresh `seq.output_text`; return True when a stop string ended the sequence."""
    text = decode(seq.output_token_ids)
    p = seq.params
    if p.stop:
        start = max(0, len(seq.output_text) - max(map(len, p.stop)))
        hits = [(text.find(s, start), s) for s in p.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            seq.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
            seq.stop_reason = s
            return True
    seq.output_text = text
    return False


def streamable_length(seq: Sequence) -> int:
    """How many characters of `seq.output_text` can be sent without ever being taken back."""
    text = seq.output_text
    if seq.is_finished:
        return len(text)
    n = len(text)
    while n and text[n - 1] == REPLACEMENT:
        n -= 1
    if seq.params.stop:
        n = min(n, len(text) - (max(map(len, seq.params.stop)) - 1))
    return max(n, 0)
