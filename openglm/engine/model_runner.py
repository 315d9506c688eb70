"""Run one scheduled step through the model over the paged KV pool.

A step mixes decodes (one token each) with prefill chunks (many tokens). Padding them into a single
`[B, T]` call would make every decode row pay for the longest chunk, so rows are grouped into
sub-batches of similar length first; each sub-batch is one model call. A hybrid model's rows (linear-attention
state per sequence, `state_cache.py`) are grouped by equal length: a padding token would move the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openglm.engine.kv_cache import KVPool, PagedBatchCache
from openglm.engine.quant import quantize_tensor
from openglm.engine.sequence import Sequence
from openglm.engine.state_cache import HybridBatchCache, StatePool, linear_layers
from openglm.model.derived import derived_weight
from openglm.model.quantized import QuantizedWeight

PAD_WASTE = 1.3  # a row may join a group when the padded size stays within 1.3x the real tokens


def group_rows(num_tokens: list[int], pad_waste: float = PAD_WASTE) -> list[list[int]]:
    """Indices grouped so that padding each group to its longest row wastes little compute (pad_waste 1: rows of
    equal length only)."""
    order = sorted(range(len(num_tokens)), key=lambda i: -num_tokens[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None:
            longest = num_tokens[g[0]]
            real = sum(num_tokens[j] for j in g) + num_tokens[i]
            if (len(g) + 1) * longest <= pad_waste * real:
                g.append(i)
                continue
        groups.append([i])
    return groups


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, pad_token_id: int = 0,
                 num_state_slots: int = 32):
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # the pool and each step's inputs live with the weights
        self.pool = KVPool(num_blocks, block_size, self.dtype, self.device)
        self.pad_token_id = pad_token_id
        layers = linear_layers(model)  # a hybrid model: one state slot per running sequence
        self.states = StatePool(layers, num_state_slots, self.dtype, self.device) if layers else None
        self.pad_waste = PAD_WASTE if self.states is None else 1.0

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_tokens: list[int]) -> torch.Tensor:
        """Compute `num_tokens[i]` new tokens of each sequence; return the logits after each row's
        last new token, `[B, vocab]` (float32)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for group in group_rows(num_tokens, self.pad_waste):
            logits = self._forward([seqs[i] for i in group], [num_tokens[i] for i in group])
            for row, i in enumerate(group):
                out[i] = logits[row]
        return torch.stack(out)

    def _forward(self, seqs: list[Sequence], new_lens: list[int]) -> torch.Tensor:
        past_lens = [s.num_computed_tokens for s in seqs]
        chunks = [s.token_ids[p : p + t] for s, p, t in zip(seqs, past_lens, new_lens)]
        rows = [(s.state_slot, s.seq_id) for s in seqs] if self.states is not None else []
        return self.execute(StepInputs(chunks, past_lens, new_lens, [list(s.block_table) for s in seqs], rows))

    def execute(self, step: "StepInputs") -> torch.Tensor:
        """One model call over the paged pool: the logits after each row's last new token, [B, vocab] fp32."""
        logits = self._call(step, lambda ids, mask, pos, cache: self.model(
            ids, attention_mask=mask, position_ids=pos, cache=cache).logits)
        last = torch.tensor(step.new_lens, device=logits.device) - 1
        return logits[torch.arange(len(step.new_lens), device=logits.device), last].float().cpu()  # sampled on the CPU

    # ---- speculative decoding (engine/speculative.py): the main model's verify step and the MTP drafts ----
    @torch.inference_mode()
    def run_verify(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Like `run`, each row's chunk followed by its draft tokens. Per row: the logits (fp32) after each of
        its last `1 + drafts` new tokens, [1 + drafts, vocab], and every new position's final-norm hidden
        state, [num_tokens, hidden] (the MTP layer's input)."""
        hidden: list = [None] * len(seqs)
        kept: list = [None] * len(seqs)
        for group in group_rows(num_tokens):
            steps = StepInputs([(seqs[i].token_ids + seqs[i].draft_token_ids)
                                [seqs[i].num_computed_tokens:][:num_tokens[i]]
                                for i in group], [seqs[i].num_computed_tokens for i in group],
                               [num_tokens[i] for i in group], [list(seqs[i].block_table) for i in group])
            h = self._call(steps, lambda ids, mask, pos, cache: self.model.hidden_states(
                ids, attention_mask=mask, position_ids=pos, cache=cache))
            for row, i in enumerate(group):
                t = num_tokens[i]
                keep = 1 + max(0, seqs[i].num_computed_tokens + t - seqs[i].num_tokens)  # drafts inside the chunk
                hidden[i], kept[i] = h[row, :t], h[row, t - keep : t]
        logits = self.model.logits(torch.cat(kept)).float().cpu()  # one pass over the head's weight for every row
        return list(logits.split([len(k) for k in kept])), hidden

    @torch.inference_mode()
    def run_mtp(self, rows: list["MTPInputs"]) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of next-n layer 0 per row over its own KV (kept at the main model's positions): the logits
        after each row's last position, [B, vocab] fp32, and its output hidden state there, [B, hidden]."""
        hidden: list = [None] * len(rows)
        for group in group_rows([len(r.next_ids) for r in rows]):
            sub = [rows[i] for i in group]
            T, H = max(len(r.next_ids) for r in sub), sub[0].hidden.shape[-1]
            h = sub[0].hidden.new_zeros((len(sub), T, H))
            for row, r in enumerate(sub):
                h[row, : len(r.next_ids)] = r.hidden
            steps = StepInputs([r.next_ids for r in sub], [r.past for r in sub], [len(r.next_ids) for r in sub],
                               [r.block_table for r in sub])
            x = self._call(steps, lambda ids, mask, pos, cache: self.model.mtp_forward(h, ids, pos, mask, cache))
            for row, i in enumerate(group):
                hidden[i] = x[row, len(rows[i].next_ids) - 1]
        hidden = torch.stack(hidden)
        return self.model.mtp_logits(hidden, head=self._draft_head()).float().cpu(), hidden

    def _draft_head(self) -> torch.Tensor:
        """The LM head weight the MTP drafts go through: an int8 copy of an fp32/bf16 head (a quarter / half of the
        bytes every draft reads; the main model checks each draft, so the copy's rounding can change how many are
        accepted, never the output), cached as a derived weight: rebuilt when the head's weight changes."""
        w = self.model.lm_head.weight
        if isinstance(w, QuantizedWeight):
            return w
        draft = derived_weight(self.model.lm_head, "draft_int8", [w],
                               lambda w: QuantizedWeight(*quantize_tensor(w, "int8"), dtype=w.dtype))
        return w if draft is None else draft  # None: an inference tensor, no version to follow

    def _call(self, step: "StepInputs", fn):
        """`fn(input_ids, mask, positions, cache)` over the step's rows laid out as `execute` lays them out."""
        past_lens, new_lens = step.past_lens, step.new_lens
        P, T, B = max(past_lens), max(new_lens), len(new_lens)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, P + T), dtype=torch.long)
        for row, (chunk, p, t) in enumerate(zip(step.token_ids, past_lens, new_lens)):
            input_ids[row, :t] = torch.tensor(chunk)
            positions[row, :t] = torch.arange(p, p + t)
            positions[row, t:] = p + t - 1
            mask[row, P - p : P + t] = 1
        to = self.device  # built on the CPU (a few small tensors per step), moved once
        if self.states is None:
            cache = PagedBatchCache(self.pool, step.block_tables, past_lens, new_lens)
        else:
            cache = HybridBatchCache(self.pool, self.states, step.block_tables, past_lens, new_lens, step.state_rows)
        return fn(input_ids.to(to), mask.to(to), positions.to(to), cache)


@dataclass
class StepInputs:
    """What one model call needs, as plain data (tensor-parallel ranks receive it from rank 0)."""
    token_ids: list[list[int]]  # each row's new tokens
    past_lens: list[int]
    new_lens: list[int]
    block_tables: list[list[int]]
    state_rows: list[tuple[int, int]] = field(default_factory=list)  # hybrid models: each row's (state slot, seq id)


@dataclass
class MTPInputs:
    """One row of an MTP call: positions past .. past + n - 1 with the token after each and the hidden state."""
    block_table: list[int]
    past: int
    next_ids: list[int]
    hidden: torch.Tensor  # [n, hidden]
