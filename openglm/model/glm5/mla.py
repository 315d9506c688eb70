"""Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention, in absorbed (latent) form.

Keys/values are never expanded per head: kv_b_proj is folded into the query (q_nope @ W_uk) and
into the output (o_latent @ W_uv^T), so attention runs directly on the cached normed latent `kv`
plus the roped key `k_pe`, which act as one shared key head of width kv_lora_rank + rope_dim.
This is what makes the DSA gather cheap: each selected key costs one latent row. DSA layers run
`sparse_dsa` (indexer top-k + attention over the selected latent rows) for prefill, chunked prefill,
decode and training alike. GLM-4.7-Flash (`glm4_lite`) runs the same attention without an indexer.
The projections, norms and per-head products are the forward's `ops` steps (`fast.py`): without autograd the
projections that read the same input run as one matmul, and a decode step's rows take the native kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model import fast
from openglm.model.attend import attend_dense, attend_latent
from openglm.model.config import ModelConfig
from openglm.model.derived import derived_weight, fused_rows
from openglm.model.glm5.indexer import Indexer
from openglm.model.glm5.sparse_dsa import FEW_QUERIES, dsa_attention, gather_attention
from openglm.model.norm import RMSNorm
from openglm.model.rope import apply_rope, softmax_scale
from openglm.model.sparse import SPARSE_PATTERN_KINDS, mla_pattern_attention, pattern_from_config


class MLAttention(nn.Module):
    indexer_class = Indexer  # a model type with another DSA indexer subclasses this with its own

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = cfg.attention_kinds[layer_idx]
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)  # eps 1e-6, as in the reference
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=bias)
        own_indexer = self.kind == "dsa" and cfg.indexer_types[layer_idx] == "full"
        self.indexer = self.indexer_class(cfg) if own_indexer else None
        self.pattern = pattern_from_config(cfg, self.kind) if self.kind in SPARSE_PATTERN_KINDS else None
        # Whether the next DSA layer reuses this layer's selection (indexer_types 'shared'): only then are the
        # slots of every query kept (Tq x k of them) after the attention.
        later = [j for j in range(layer_idx + 1, cfg.num_hidden_layers) if cfg.is_dsa(j)]
        self.selection_shared = bool(own_indexer and later and cfg.indexer_types[later[0]] == "shared")

    def forward(self, x, rot, key_valid, past: int, cache=None, prev_selection=None, ops: fast.Reference | None = None):
        """x [B,T,hidden] (normed); rot: the forward's `rope.Rotation`; ops: its paths (`fast.choose`). Returns
        (output [B,T,hidden], DSA selection for a following 'shared' layer: key slots [B,T,k], -1 = none; else None)."""
        ops = ops or fast.choose(x)
        B, T, _ = x.shape
        q_a, kv_pe, *indexer_parts = ops.linears(self, "input", self.input_linears(), x)
        kv, k_pe = kv_pe.split([self.rank, self.rope], dim=-1)
        index_k, index_w = (indexer_parts + [None, None])[:2]
        q_resid = ops.norm(self.q_a_layernorm, q_a)
        q, *index_q = ops.linears(self, "query", self.query_linears(), q_resid)
        q = q.view(B, T, self.n_heads, self.nope + self.rope)
        entries = {"kv": ops.norm(self.kv_a_layernorm, kv), "k_pe": self._rope(k_pe, rot)}
        if self.indexer is not None:
            # Cached in the model dtype, as transformers does: every decode step reads every cached key, and a
            # bf16 key is half the bytes (the scores are fp32 either way: sparse_dsa and decode_kernels widen it).
            entries.update(self.indexer.entries(x, rot, projected=index_k))
        if cache is not None:
            entries = cache.update(self.layer_idx, entries)
        # Absorb W_uk into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        q_lat = ops.per_head(self, "w_uk_t", q[..., : self.nope], self.kv_b_proj.weight, self._uk_t)  # [B,T,H,rank]
        q_full = torch.cat([q_lat, self._rope(q[..., self.nope:], rot)], dim=-1) if self.rope else q_lat
        keys = latent_keys(entries["kv"], entries["k_pe"])  # [B, N, 1, rank+rope]
        selection, chunk = None, self.cfg.attn_query_chunk
        if self.kind == "dsa":
            index_q = index_q[0] if index_q else None
            o_lat, selection = self._dsa(x, rot, q_full, keys, entries, index_q, index_w, key_valid, prev_selection)
        elif self.pattern is not None:  # local+global+random / sliding window: block-sparse over the latents
            o_lat = mla_pattern_attention(q_full, keys, self.rank, self.pattern, self.scale, key_valid, chunk)
        else:
            # Values = the whole key row, sliced after: SDPA's fused (flash) kernel needs equal key and value
            # widths; with values of width `rank` it falls back to materialising the T x N scores.
            o_lat = attend_dense(q_full, keys, keys, key_valid, past, self.scale, chunk)[..., : self.rank]
        # Un-absorb W_uv: o_h = W_uv (sum_j p_j c_j)
        o = ops.per_head(self, "w_uv", o_lat, self.kv_b_proj.weight, self._uv)  # [B, T, H, v]
        return ops.linear(self.o_proj, o.reshape(B, T, self.n_heads * self.v_dim)), selection

    def _rope(self, x: torch.Tensor, rot) -> torch.Tensor:
        """x's rope slice rotated; NoPE attention (qk_rope_head_dim 0, no `rot`) has none to rotate."""
        return apply_rope(x, rot.rope) if self.rope else x

    def _dsa(self, x, rot, q_full, keys, entries, index_q, index_w, key_valid, prev_selection):
        """DSA over the latent keys in `sparse_dsa`'s layout (views, no copies): q [B,H,T,D], one key head
        [B,1,N,D] whose first `rank` channels are the values. With an own indexer: its top-k, then attention
        over those keys; a 'shared' layer attends over the previous DSA layer's slots. Returns (o_lat
        [B,T,H,rank], the slots for following shared layers, or None when none follows)."""
        if self._selects_all(q_full.shape[1], keys.shape[1], key_valid):
            return attend_latent(q_full, keys, self.rank, keys.shape[1] - q_full.shape[1], self.scale), None
        q, k = q_full.transpose(1, 2), keys.transpose(1, 2)
        v = k[..., : self.rank]
        if self.indexer is None:
            return gather_attention(q, k, v, prev_selection, scale=self.scale).transpose(1, 2), prev_selection
        index_q, weights = self.indexer.queries(x, rot.index, index_q, index_w)
        out = dsa_attention(q, k, v, index_q, entries["index_k"], weights, self.indexer.topk, scale=self.scale,
                            index_scale=self.indexer.softmax_scale, key_mask=key_valid,
                            query_chunk=self.cfg.attn_query_chunk, return_slots=self.selection_shared)
        out, slots = out if self.selection_shared else (out, None)
        return out.transpose(1, 2), slots

    def _selects_all(self, n_queries: int, n_keys: int, key_valid) -> bool:
        """Whether DSA's top-k keeps every visible key of every query (at most index_topk keys, no padding):
        then it is exactly causal attention, and a prefill runs it as `attend_latent` instead of gathering all
        keys per query (bf16 prefill at 512 tokens spent ~30% of its time in that gather's copies and bmms).
        Decode-sized blocks stay on the DSA path; a 'shared' layer sees the same counts, so it takes this
        path too and needs no selection."""
        return key_valid is None and n_queries > FEW_QUERIES and n_keys <= self.cfg.index_topk

    def _uk_t(self, w: torch.Tensor) -> torch.Tensor:
        """W_uk transposed per head, [H, rank, nope], a view of kv_b_proj's weight w: what the query absorbs."""
        return w.view(self.n_heads, self.nope + self.v_dim, self.rank)[:, : self.nope].transpose(1, 2)

    def _uv(self, w: torch.Tensor) -> torch.Tensor:
        """W_uv [H, v, rank], a view of kv_b_proj's weight w: what the output un-absorbs."""
        return w.view(self.n_heads, self.nope + self.v_dim, self.rank)[:, self.nope:]

    def w_uk_t(self) -> torch.Tensor | None:
        """`_uk_t` contiguous (cached; None: see `derived_weight`): the weight of a decode step's absorption, the
        inference path's per-head product here and `decode_step`'s."""
        return derived_weight(self, "w_uk_t", [self.kv_b_proj.weight], lambda w: self._uk_t(w).contiguous())

    def input_linears(self) -> list[nn.Linear]:
        """The Linears that read the layer's normed input, in the order of their fused weight's rows: q_a, kv_a
        (latent then k_pe) and, with an own indexer, its key projection and, when fp32, its head weights (a bf16
        model computes those from an fp32 copy, as transformers does)."""
        linears = [self.q_a_proj, self.kv_a_proj_with_mqa]
        if self.indexer is not None:
            linears.append(self.indexer.wk)
            if self.indexer.weights_proj.weight.dtype == torch.float32:
                linears.append(self.indexer.weights_proj)
        return linears

    def query_linears(self) -> list[nn.Linear]:
        """The Linears that read the normed q latent: q_b and, with an own indexer, its query projection."""
        return [self.q_b_proj] if self.indexer is None else [self.q_b_proj, self.indexer.wq_b]

    def query_weight(self) -> torch.Tensor | None:
        """The stacked weight of `query_linears` as the inference path uses it (None: see `fused_rows`)."""
        if self.indexer is None:
            return self.q_b_proj.weight
        return fused_rows(self, "query", self.query_linears())


def latent_keys(kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The one MLA key head [B, N, 1, rank+rope] = kv | k_pe. A zero-copy view when the cache stores
    k_pe right after kv in each row (DynamicCache does), so decode never re-copies the whole cache."""
    rank, rope = kv.shape[-1], k_pe.shape[-1]
    if (kv.dim() == 3 and kv.shape[:2] == k_pe.shape[:2] and kv.dtype == k_pe.dtype
            and kv.stride() == k_pe.stride() and kv.stride(-1) == 1 and kv.stride(1) >= rank + rope
            and k_pe.data_ptr() == kv.data_ptr() + rank * kv.element_size()
            and kv.untyped_storage().data_ptr() == k_pe.untyped_storage().data_ptr()):
        B, N = kv.shape[:2]
        return kv.as_strided((B, N, 1, rank + rope), (kv.stride(0), kv.stride(1), rank + rope, 1))
    return torch.cat([kv, k_pe], dim=-1).unsqueeze(2)
