"""Self-speculative decoding with the checkpoint's MTP (next-n) layer: the acceptance rules.

Each decoding sequence carries up to k draft tokens proposed by the MTP layer; the main model scores
the last token plus all drafts in one forward, and these rules decide how many drafts survive:
- greedy: the longest prefix of drafts equal to the main model's argmax, plus the argmax after it
  (the "bonus" token), so the output equals plain greedy decoding token for token;
- sampling (Leviathan et al. / Chen et al. speculative sampling): draft x ~ q is kept with probability
  min(1, p(x)/q(x)); on the first rejection the token is drawn from norm(max(0, p - q)); when every
  draft is kept, a bonus token is drawn from p. The output is distributed exactly as sampling from p.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """target_logits [len(drafts) + 1, vocab]: row i scores the token after draft i-1. Returns the tokens
    to append: the accepted drafts and the main model's own token after them."""
    best = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return drafts[:n] + [best[n]]


def accept_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> list[int]:
    """draft_probs [k, vocab] (q, what each draft was drawn from), target_probs [k + 1, vocab] (p)."""
    out = []
    for i, x in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, dtype=p.dtype)
        if q[x] > 0 and u * q[x] <= p[x]:  # u < p/q, written without dividing
            out.append(x)
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out


def drafts_allowed(k: int, num_tokens: int, num_output_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """How many drafts a sequence may carry: the verify step's positions must fit the context, and drafting
    past max_tokens is wasted work (a finished sequence discards them)."""
    return max(0, min(k, max_model_len - num_tokens, max_tokens - num_output_tokens - 1))
