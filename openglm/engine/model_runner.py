"""Run one scheduled step through the model over the paged KV pool.

A step mixes decodes (one token each) with prefill chunks (many tokens). Padding them into a single
`[B, T]` call would make every decode row pay for the longest chunk, so rows are grouped into
sub-batches of similar length first; each sub-batch is one model call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openglm.engine.kv_cache import KVPool, PagedBatchCache
from openglm.engine.sequence import Sequence

PAD_WASTE = 1.3  # a row may join a group when the padded size stays within 1.3x the real tokens


def group_rows(num_tokens: list[int]) -> list[list[int]]:
    """Indices grouped so that padding each group to its longest row wastes little compute."""
    order = sorted(range(len(num_tokens)), key=lambda i: -num_tokens[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None:
            longest = num_tokens[g[0]]
            real = sum(num_tokens[j] for j in g) + num_tokens[i]
            if (len(g) + 1) * longest <= PAD_WASTE * real:
                g.append(i)
                continue
        groups.append([i])
    return groups


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, pad_token_id: int = 0):
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.pool = KVPool(num_blocks, block_size, self.dtype)
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_tokens: list[int]) -> torch.Tensor:
        """Compute `num_tokens[i]` new tokens of each sequence; return the logits after each row's
        last new token, `[B, vocab]` (float32)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for group in group_rows(num_tokens):
            logits = self._forward([seqs[i] for i in group], [num_tokens[i] for i in group])
            for row, i in enumerate(group):
                out[i] = logits[row]
        return torch.stack(out)

    def _forward(self, seqs: list[Sequence], new_lens: list[int]) -> torch.Tensor:
        past_lens = [s.num_computed_tokens for s in seqs]
        chunks = [s.token_ids[p : p + t] for s, p, t in zip(seqs, past_lens, new_lens)]
        return self.execute(StepInputs(chunks, past_lens, new_lens, [list(s.block_table) for s in seqs]))

    def execute(self, step: "StepInputs") -> torch.Tensor:
        """One model call over the paged pool: the logits after each row's last new token, [B, vocab] fp32."""
        past_lens, new_lens = step.past_lens, step.new_lens
        P, T, B = max(past_lens), max(new_lens), len(new_lens)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, P + T), dtype=torch.long)
        for row, (chunk, p, t) in enumerate(zip(step.token_ids, past_lens, new_lens)):
            input_ids[row, :t] = torch.tensor(chunk)
            positions[row, :t] = torch.arange(p, p + t)
            positions[row, t:] = p + t - 1  # padding rows: any valid position, their outputs are unused
            mask[row, P - p : P + t] = 1
        cache = PagedBatchCache(self.pool, step.block_tables, past_lens, new_lens)
        logits = self.model(input_ids, attention_mask=mask, position_ids=positions, cache=cache).logits
        last = torch.tensor(new_lens) - 1
        return logits[torch.arange(B), last].float()


@dataclass
class StepInputs:
    """What one model call needs, as plain data (tensor-parallel ranks receive it from rank 0)."""
    token_ids: list[list[int]]  # each row's new tokens
    past_lens: list[int]
    new_lens: list[int]
    block_tables: list[list[int]]
