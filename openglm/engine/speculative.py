"""Self-speculative decoding with the checkpoint's MTP (next-n) layer.

Each decoding sequence carries up to k draft tokens proposed by the MTP layer; the main model scores
the last token plus all drafts in one forward (`SpeculativeDecoder.run`, the engine's run phase when
drafts are on), and these rules decide how many drafts survive:
- greedy: the longest prefix of drafts equal to the main model's argmax, plus the argmax after it
  (the "bonus" token), so the output equals plain greedy decoding token for token;
- sampling (Leviathan et al. / Chen et al. speculative sampling): draft x ~ q is kept with probability
  min(1, p(x)/q(x)); on the first rejection the token is drawn from norm(max(0, p - q)); when every
  draft is kept, a bonus token is drawn from p. The output is distributed exactly as sampling from p.
After the tokens are appended, `SpeculativeDecoder.propose` runs the MTP layer for the next drafts.
"""

from __future__ import annotations

from typing import Callable

import torch

from openglm.engine.block_manager import BlockManager
from openglm.engine.model_runner import ModelRunner, MTPInputs
from openglm.engine.postprocess import RowResult
from openglm.engine.sampler import Sampler
from openglm.engine.sequence import Sequence

# (logits of ready rows, their sequences) -> (tokens, logprobs): the engine's sampling, grammar masks included
SampleFn = Callable[[torch.Tensor, list[Sequence]], tuple[list[int], list]]


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


class SpeculativeDecoder:
    """The run phase with MTP drafts, and the drafting that follows each step."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, block_manager: BlockManager, k: int,
                 max_model_len: int, counters: dict[str, int]):
        if not len(getattr(getattr(runner.model, "model", None), "mtp_layers", ())):
            raise ValueError("num_speculative_tokens > 0 needs a checkpoint with a next-n (MTP) layer "
                             "(config num_nextn_predict_layers >= 1); this one has none")
        self.runner, self.sampler, self.block_manager = runner, sampler, block_manager
        self.k, self.max_model_len = k, max_model_len
        self.counters = counters  # the engine's: draft_tokens and accepted_draft_tokens are counted here

    def run(self, seqs: list[Sequence], num_tokens: list[int], sample: SampleFn) -> list[RowResult]:
        """Each decoding row's drafts are verified in the same forward; the accepted ones plus one more token are
        its new tokens. Rows without drafts are sampled exactly as the plain run samples them. Changes nothing."""
        logits, hidden = self.runner.run_verify(seqs, num_tokens)
        rows = [row for row, (seq, n) in enumerate(zip(seqs, num_tokens))
                if seq.num_computed_tokens + n >= seq.num_tokens]  # the inputs reach the end: new token(s)
        plain = [row for row in rows if not seqs[row].draft_token_ids]
        new: dict[int, tuple[list[int], list]] = {}
        if plain:
            tokens, logprobs = sample(torch.stack([logits[row][-1] for row in plain]), [seqs[row] for row in plain])
            new.update({row: ([t], [lp]) for row, t, lp in zip(plain, tokens, logprobs)})
        drafted = [row for row in rows if row not in new]
        for row in drafted:
            tokens = self._verify(seqs[row], logits[row])
            new[row] = (tokens, [None] * len(tokens))
        self.counters["draft_tokens"] += sum(len(seqs[row].draft_token_ids) for row in drafted)
        self.counters["accepted_draft_tokens"] += sum(len(new[row][0]) - 1 for row in drafted)
        results = []
        for row, (seq, n) in enumerate(zip(seqs, num_tokens)):
            tokens, logprobs = new.get(row, ([], []))
            computed = len(tokens) if tokens and seq.draft_token_ids else n  # the last token + accepted drafts
            results.append(RowResult(seq, computed, tokens, logprobs, hidden[row]))
        return results

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        if seq.params.greedy:
            return accept_greedy(seq.draft_token_ids, logits)
        target = self.sampler.probs(logits, [seq] * len(logits))
        return accept_sampled(seq.draft_token_ids, seq.draft_probs, target, self.sampler.generator_for(seq))

    def propose(self, results: list[RowResult]) -> None:
        """Draft the next tokens of every row that may have them. Drafts only speed decoding up: if drafting
        fails, the next step decodes one token per row."""
        try:
            self._propose(results)
        except Exception:  # noqa: BLE001 - without drafts the next step decodes one token
            for r in results:
                r.seq.set_drafts([])

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        """Drafts are verified without the sampler's per-token state, so rows that need it decode plainly."""
        p = seq.params
        return (not seq.is_finished and seq.matcher is None and p.logprobs is None and p.repetition_penalty == 1.0
                and not p.presence_penalty and not p.frequency_penalty and p.thinking_budget is None)

    def _propose(self, results: list[RowResult]) -> None:
        """Run the MTP layer over every position the main model just kept (its KV stays in step with the
        main model's), then chain it on its own output for up to k drafts per decoding sequence."""
        todo = [(r.seq, r.computed, r.hidden) for r in results if self._may_draft(r.seq)]
        if not todo:
            return
        rows = [MTPInputs(list(seq.block_table), seq.num_computed_tokens - keep,
                          seq.token_ids[seq.num_computed_tokens - keep + 1 : seq.num_computed_tokens + 1], h[:keep])
                for seq, keep, h in todo]
        logits, x = self.runner.run_mtp(rows)
        active = []
        for i, (seq, _, _) in enumerate(todo):
            n = drafts_allowed(self.k, seq.num_tokens, seq.num_output_tokens, seq.params.max_tokens,
                               self.max_model_len)
            if seq.num_uncomputed_tokens != 1 or n == 0:
                continue  # mid-prefill: this call only filled the MTP layer's KV
            if n > 1 and self.block_manager.can_append(seq, n):
                self.block_manager.append(seq, n)  # chained drafts write MTP KV past the last token
            else:
                n = 1
            active.append((i, seq, n))
        drafts: dict[int, list] = {i: [] for i, _, _ in active}
        probs: dict[int, list] = {i: [] for i, _, _ in active}
        row_of = {i: i for i, _, _ in active}  # row of `logits` / `x` holding sequence i's last MTP output
        for depth in range(self.k):
            live = [(i, seq) for i, seq, n in active if depth < n]
            if not live:
                break
            if depth:  # chain: the layer's own output at the previous position, the draft it just made
                logits, x = self.runner.run_mtp([MTPInputs(list(seq.block_table), seq.num_computed_tokens + depth - 1,
                                                           [drafts[i][-1]], x[row_of[i] : row_of[i] + 1])
                                                 for i, seq in live])
                row_of = {i: j for j, (i, _) in enumerate(live)}
            for i, seq in live:
                row = logits[row_of[i]]
                if seq.params.greedy:
                    drafts[i].append(int(row.argmax()))
                    continue
                q = self.sampler.probs(row[None], [seq])[0]
                drafts[i].append(int(torch.multinomial(q, 1, generator=self.sampler.generator_for(seq))))
                probs[i].append(q)
        for i, seq, _ in active:
            seq.set_drafts(drafts[i], torch.stack(probs[i]) if probs[i] else None)
