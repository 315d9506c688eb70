"""GLM-5.3's indexed attention: MLA without RoPE (`MLAttention` with qk_rope_head_dim 0) whose DSA indexer scores
groups of `index_kpool` consecutive keys (`sparse_dsa.pooled_topk_slots`), then attends over the selected keys
(`sparse_dsa.gather_attention`, shared with GLM-5's DSA and with the 'shared' layers that reuse a selection)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openglm.model.attend import attend_latent
from openglm.model.config import ModelConfig
from openglm.model.glm5.indexer import Indexer
from openglm.model.glm5.mla import MLAttention
from openglm.model.glm5.sparse_dsa import gather_attention, pooled_topk_slots


class PooledIndexer(Indexer):
    """GLM-5's indexer heads without RoPE, plus the key-group pooling: `index_kpool_compress_gate` [d, hidden]
    scores each key for its group's weighted mean (with `index_kpool_compress_ape` [kpool, d] by place in the
    group). The cache holds each key and its pooling score (`index_k`, `index_gate`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.kpool, self.select_tail = cfg.index_kpool, cfg.index_kpool_always_select_tail
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.index_kpool, cfg.index_head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(cfg.index_head_dim, cfg.hidden_size))

    def keys(self, x: torch.Tensor, rot=None, projected=None) -> torch.Tensor:
        return self.k_norm(self.wk(x) if projected is None else projected)

    def entries(self, x: torch.Tensor, rot=None, projected=None) -> dict[str, torch.Tensor]:
        return {"index_k": self.keys(x, projected=projected),
                "index_gate": F.linear(x, self.index_kpool_compress_gate).to(x.dtype)}

    @torch.no_grad()
    def queries(self, x, rot, projected, head_weights=None):
        B, T, _ = x.shape
        if head_weights is None:
            head_weights = F.linear(x.float(), self.weights_proj.weight.float())
        return projected.view(B, T, self.n_heads, self.head_dim).float(), head_weights.float() * self.n_heads ** -0.5


class IndexedAttention(MLAttention):
    indexer_class = PooledIndexer

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = cfg.rms_norm_eps  # GLM-5 uses 1e-6 here

    def _dsa(self, x, rot, q_full, keys, entries, index_q, index_w, key_valid, prev_selection):
        """As MLAttention._dsa, with the pooled selection: (o_lat [B, T, H, rank], the slots for a following
        'shared' layer or None)."""
        T, N = q_full.shape[1], keys.shape[1]
        if self._selects_all(T, N, key_valid):  # every visible key fits the budget: exactly causal attention
            return attend_latent(q_full, keys, self.rank, N - T, self.scale), None
        q, k = q_full.transpose(1, 2), keys.transpose(1, 2)
        v = k[..., : self.rank]
        if self.indexer is None:
            slots = prev_selection
        else:
            index_q, weights = self.indexer.queries(x, rot, index_q, index_w)
            ix = self.indexer
            slots = pooled_topk_slots(index_q, entries["index_k"], entries["index_gate"], ix.index_kpool_compress_ape,
                                      weights, ix.topk, ix.kpool, scale=ix.softmax_scale, key_mask=key_valid,
                                      query_mask=None if key_valid is None else key_valid[:, N - T:],
                                      select_tail=ix.select_tail)
        out = gather_attention(q, k, v, slots, scale=self.scale).transpose(1, 2)
        return out, (slots if self.indexer is None or self.selection_shared else None)
