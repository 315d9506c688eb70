"""Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention, in absorbed (latent) form.

Keys/values are never expanded per head: kv_b_proj is folded into the query (q_nope @ W_uk) and
into the output (o_latent @ W_uv^T), so attention runs directly on the cached normed latent `kv`
plus the roped key `k_pe`, which act as one shared key head of width kv_lora_rank + rope_dim.
This is what makes the DSA gather cheap: each selected key costs one latent row. DSA layers run
`sparse_dsa` (indexer top-k + attention over the selected latent rows) for prefill, chunked prefill,
decode and training alike.
"""

from __future__ import annotations

import torch
from torch import nn

from openglm.model.attend import attend_dense, attend_latent
from openglm.model.config import ModelConfig
from openglm.model.indexer import Indexer
from openglm.model.native import heads_linear, linear, max_rows
from openglm.model.norm import RMSNorm
from openglm.model.rope import apply_rope, softmax_scale
from openglm.model.sparse import SPARSE_PATTERN_KINDS, mla_pattern_attention, pattern_from_config
from openglm.model.sparse_dsa import FEW_QUERIES, dsa_attention, gather_attention
from openglm.model.derived import derived_weight, fused_rows


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
        # Whether the next DSA layer reuses this layer's selection (indexer_types 'shared'): only then are the
        # slots of every query kept (Tq x k of them) after the attention.
        later = [j for j in range(layer_idx + 1, cfg.num_hidden_layers) if cfg.attention_kinds[j] == "dsa"]
        self.selection_shared = bool(own_indexer and later and cfg.indexer_types[later[0]] == "shared")

    def forward(self, x, rot, key_valid, past: int, cache=None, prev_selection=None):
        """x [B,T,hidden] (normed); rot: the forward's `rope.Rotation`. Returns (output [B,T,hidden], DSA
        selection for a following 'shared' layer: key slots [B,T,k], -1 = none; else None)."""
        B, T, _ = x.shape
        q_a, kv, k_pe, index_k, index_w = self._project_input(x)
        q_resid = self.q_a_layernorm(q_a)
        q, index_q = self._project_query(q_resid)
        q = q.view(B, T, self.n_heads, self.nope + self.rope)
        entries = {"kv": self.kv_a_layernorm(kv), "k_pe": apply_rope(k_pe, rot.rope)}
        if self.indexer is not None:
            # Cached in the model dtype, as transformers does: every decode step reads every cached key, and a
            # bf16 key is half the bytes (the scores are fp32 either way: sparse_dsa and decode_kernels widen it).
            entries["index_k"] = self.indexer.keys(x, rot.index, projected=index_k)
        if cache is not None:
            entries = cache.update(self.layer_idx, entries)
        # Absorb W_uk into the query: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        q_lat, w_uv = self._absorb_query(q[..., : self.nope])  # [B, T, H, rank]
        q_full = torch.cat([q_lat, apply_rope(q[..., self.nope:], rot.rope)], dim=-1)
        keys = latent_keys(entries["kv"], entries["k_pe"])  # [B, N, 1, rank+rope]
        selection, chunk = None, self.cfg.attn_query_chunk
        if self.kind == "dsa":
            o_lat, selection = self._dsa(x, rot, q_full, keys, entries, index_q, index_w, key_valid, prev_selection)
        elif self.pattern is not None:  # local+global+random / sliding window: block-sparse over the latents
            o_lat = mla_pattern_attention(q_full, keys, self.rank, self.pattern, self.scale, key_valid, chunk)
        else:
            # Values = the whole key row, sliced after: SDPA's fused (flash) kernel needs equal key and value
            # widths; with values of width `rank` it falls back to materialising the T x N scores.
            o_lat = attend_dense(q_full, keys, keys, key_valid, past, self.scale, chunk)[..., : self.rank]
        # Un-absorb W_uv: o_h = W_uv (sum_j p_j c_j)
        o = self._unabsorb(o_lat, w_uv)  # [B, T, H, v]
        o = o.reshape(B, T, self.n_heads * self.v_dim)
        # Inference skips the module call (as the fused projections do) so a decode step can take `linear`'s rows path.
        plain = self.o_proj.bias is None and not torch.is_grad_enabled()
        return (linear(o, self.o_proj.weight) if plain else self.o_proj(o)), selection

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

    def _absorb_query(self, q_nope):
        """(W_uk^T q_nope [B,T,H,rank], W_uv [H,v,rank] for `_unabsorb`). A decode step's few rows take
        `heads_linear` (decode_kernels.c) over a cached per-head transposed W_uk in the model dtype: one call
        per layer streaming the weight, where the bmm's set-up cost more than its read."""
        B, T = q_nope.shape[:2]
        w = self.kv_b_proj.weight
        w_kv = w.view(self.n_heads, self.nope + self.v_dim, self.rank)
        if B * T <= max_rows() and not torch.is_grad_enabled():
            w_uk_t = self.w_uk_t()
            if w_uk_t is not None:
                out = heads_linear(q_nope.reshape(B * T, self.n_heads, self.nope), w_uk_t)
                if out is not None:
                    return out.view(B, T, self.n_heads, self.rank), w_kv[:, self.nope:]
        w_kv = self._absorbed_weight(B * T).view(self.n_heads, self.nope + self.v_dim, self.rank)
        return per_head_matmul(q_nope, w_kv[:, : self.nope]), w_kv[:, self.nope:]

    def w_uk_t(self) -> torch.Tensor | None:
        """W_uk transposed per head, [H, rank, nope] contiguous (cached; None: see `derived_weight`): the weight of
        a decode step's absorption, `heads_linear` here and `decode_step`'s."""
        return derived_weight(self, "w_uk_t", [self.kv_b_proj.weight], lambda w: w.view(
            self.n_heads, self.nope + self.v_dim, self.rank)[:, : self.nope].transpose(1, 2).contiguous())

    def _unabsorb(self, o_lat, w_uv):
        """o_lat [B,T,H,rank] times W_uv [H,v,rank] per head -> [B,T,H,v] (`heads_linear` for a decode step)."""
        B, T = o_lat.shape[:2]
        if w_uv.dtype == o_lat.dtype or w_uv.dtype == torch.float32:
            out = heads_linear(o_lat.reshape(B * T, self.n_heads, self.rank), w_uv)
            if out is not None:
                return out.view(B, T, self.n_heads, self.v_dim)
        return per_head_matmul(o_lat, w_uv.transpose(1, 2))

    def _absorbed_weight(self, rows: int) -> torch.Tensor:
        """kv_b_proj's weight for the absorbed products; for a few rows (decode) without autograd in
        bf16/fp16 an fp32 copy, so `per_head_matmul` runs in fp32: a reduced-precision bmm this small costs
        ~2x more in oneDNN set-up than the fp32 product, and it accumulates in fp32 too (same result up to
        summation order). Prefill-sized products stay in bf16, where oneDNN is the faster one."""
        w = self.kv_b_proj.weight
        if w.dtype in (torch.bfloat16, torch.float16) and rows <= 64 and not torch.is_grad_enabled():
            fp32 = derived_weight(self, "kv_b_fp32", [w], lambda w: w.float())
            return w if fp32 is None else fp32
        return w

    def _project_input(self, x):
        """The projections of x: q_a [B,T,q_lora], kv latent [B,T,rank], k_pe [B,T,rope], and with an own
        indexer its key projection [B,T,index_head_dim] (else None) and, when the fused path computed them,
        its raw per-head weights [B,T,index_n_heads] (else None: the indexer computes them). Without
        autograd they are one matmul over the stacked weights; training keeps the separate Linears."""
        linears = self.input_linears()
        w = None if torch.is_grad_enabled() else fused_rows(self, "input", linears)
        if w is None:
            q_a, kv_pe = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
            index_k = self.indexer.wk(x) if self.indexer is not None else None
            return q_a, *kv_pe.split([self.rank, self.rope], dim=-1), index_k, None
        sizes = [self.q_a_proj.out_features, self.rank, self.rope] + [lin.out_features for lin in linears[2:]]
        parts = linear(x, w).split(sizes, dim=-1)
        return (*parts[:3], parts[3] if len(parts) > 3 else None, parts[4] if len(parts) > 4 else None)

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

    def query_weight(self) -> torch.Tensor | None:
        """The weight of q_resid's projections without autograd: q_b_proj's, stacked with the indexer's wq_b when the
        layer has an own indexer (None: see `fused_rows`)."""
        if self.indexer is None:
            return self.q_b_proj.weight
        return fused_rows(self, "query", [self.q_b_proj, self.indexer.wq_b])

    def _project_query(self, q_resid):
        """q [B,T,H*(nope+rope)] and, with an own indexer, its query projection (else None): one matmul
        without autograd, as in `_project_input`."""
        if self.indexer is None:  # `linear`: its decode rows path without the module call
            return linear(q_resid, self.q_b_proj.weight) if not torch.is_grad_enabled() else self.q_b_proj(q_resid), None
        w = None if torch.is_grad_enabled() else self.query_weight()
        if w is None:
            return self.q_b_proj(q_resid), self.indexer.wq_b(q_resid)
        q, index_q = linear(q_resid, w).split([self.q_b_proj.out_features, self.indexer.wq_b.out_features], dim=-1)
        return q, index_q


def per_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, i] times w [H, i, o] per head -> [B, T, H, o] in x's dtype, as one bmm over heads with
    B*T rows each (a broadcast matmul would copy w per sequence), computed in w's dtype."""
    B, T, H, i = x.shape
    out = torch.bmm(x.reshape(B * T, H, i).transpose(0, 1).to(w.dtype), w)  # [H, B*T, o]
    return out.transpose(0, 1).view(B, T, H, w.shape[-1]).to(x.dtype)


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
