"""Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention, in absorbed (latent) form.

Keys/values are never expanded per head: kv_b_proj is folded into the query (q_nope @ W_uk) and
into the output (o_latent @ W_uv^T), so attention runs directly on the cached normed latent `kv`
plus the roped key `k_pe`, which act as one shared key head of width kv_lora_rank + rope_dim.
This is what makes the DSA gather cheap: each selected key costs one latent row.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model.attend import attend_dense, attend_gathered
from openglm.model.config import ModelConfig
from openglm.model.indexer import Indexer
from openglm.model.norm import RMSNorm
from openglm.model.rope import apply_rope, softmax_scale
from openglm.model.sparse import SPARSE_PATTERN_KINDS, mla_pattern_attention, pattern_from_config


class MLAttention(nn.Module):
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
        self.indexer = Indexer(cfg) if own_indexer else None
        self.pattern = pattern_from_config(cfg, self.kind) if self.kind in SPARSE_PATTERN_KINDS else None

    def forward(self, x, cos, sin, key_valid, past: int, cache=None, prev_selection=None):
        """x [B,T,hidden] (normed). Returns (output [B,T,hidden], DSA selection for a following
        'shared' layer: (indices, valid), or None meaning 'every visible key')."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, T, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        entries = {"kv": self.kv_a_layernorm(kv), "k_pe": apply_rope(k_pe, cos, sin)}
        if self.indexer is not None:
            entries["index_k"] = self.indexer.keys(x, cos, sin)
        if cache is not None:
            entries = cache.update(self.layer_idx, entries)
        w_kv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope], w_kv[:, self.nope:]
        # Absorb W_uk into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        # (einsum batches over heads with B*T rows each: a broadcast matmul would copy W_uk per sequence)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # [B, T, H, rank]
        q_full = torch.cat([q_lat, apply_rope(q_pe, cos, sin)], dim=-1)
        keys = latent_keys(entries["kv"], entries["k_pe"])  # [B, N, 1, rank+rope]
        selection = None
        if self.kind == "dsa":
            if self.indexer is not None:
                selection = self.indexer.select(x, q_resid, cos, sin, entries["index_k"], key_valid, past)
            else:
                selection = prev_selection
        chunk = self.cfg.attn_query_chunk
        if self.pattern is not None:  # local+global+random / sliding window: block-sparse over the latents
            o_lat = mla_pattern_attention(q_full, keys, self.rank, self.pattern, self.scale, key_valid, chunk)
        elif selection is None:
            o_lat = attend_dense(q_full, keys, keys[..., : self.rank], key_valid, past, self.scale, chunk)
        else:
            o_lat = attend_gathered(q_full, keys, None, *selection, self.scale, v_dim=self.rank, query_chunk=chunk)
        # Un-absorb W_uv: o_h = W_uv (sum_j p_j c_j)
        o = torch.einsum("bthr,hvr->bthv", o_lat, w_uv)  # [B, T, H, v]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.v_dim)), selection


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
