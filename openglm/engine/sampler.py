"""Turn the last-position logits of a batch into next tokens (and logprobs).

Order of operations follows vLLM: penalties on the raw logits, then temperature, then the
top-k / top-p / min-p filters, then a draw. Temperature 0 is greedy (argmax of the penalised
logits). Logprobs are reported from the model's raw distribution.
"""

from __future__ import annotations

import torch

from openglm.engine.sequence import Sequence
from openglm.model.sampling import filter_logits as top_k_top_p


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in seq.token_ids if t < vocab}), dtype=torch.long)
            if len(seen):
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long).clamp_(max=vocab - 1)
            counts = torch.zeros(vocab, dtype=logits.dtype).scatter_add_(
                0, out, torch.ones(len(out), dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Top-k, top-p and min-p, each row with its own settings (filtered entries become -inf)."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.top_k > 0 or p.top_p < 1.0:  # the same top-k / top-p as training-time generation
            logits[i] = top_k_top_p(logits[i], max(p.top_k, 0), p.top_p)
        if p.min_p > 0.0:
            row = logits[i]
            probs = row.softmax(-1)
            row.masked_fill_(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _generator(seq: Sequence) -> torch.Generator | None:
    if seq.params.seed is None:
        return None
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.params.seed + seq.index)
    return seq.generator


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict | None]]:
        raw = logits.float()
        logits = apply_penalties(raw.clone(), seqs)
        tokens = logits.argmax(-1).tolist()
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            temps = torch.tensor([seqs[i].params.temperature for i in sampled_rows]).unsqueeze(1)
            sub = filter_logits(logits[sampled_rows] / temps, [seqs[i] for i in sampled_rows])
            probs = sub.softmax(-1)
            for j, i in enumerate(sampled_rows):
                gen = _generator(seqs[i]) or self.generator
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen))
        return tokens, self._logprobs(raw, tokens, seqs)

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The sequence's own generator (params.seed) or the engine's."""
        return _generator(seq) or self.generator

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution a sampled (non-greedy, no penalties) row draws from: temperature, then filters."""
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype).unsqueeze(1)
        return filter_logits(logits.float() / temps, seqs).softmax(-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> list[dict | None]:
        out: list[dict | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return out
        logp = raw[rows].log_softmax(-1)
        for j, i in enumerate(rows):
            k = seqs[i].params.logprobs
            top = torch.topk(logp[j], k) if k else None
            out[i] = {
                "token_id": tokens[i],
                "logprob": float(logp[j, tokens[i]]),
                "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            }
        return out
