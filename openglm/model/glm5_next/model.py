"""GLM-5.3-Flash's text model (`glm5_next`): `Glm5NextForCausalLM`.

Each decoder layer is a KDA linear-attention layer or an indexed (NoPE MLA + pooled DSA) layer, per `layer_types`,
then a dense or MoE SwiGLU (clamped at `swiglu_limit`), per `mlp_layer_types`; both blocks sit inside
hyper-connections over `hc_mult` residual streams, whose mean feeds the final norm. The next-n (MTP) layers are
GLM-5's plain pre-norm blocks (`model.NextNLayer`) with this family's indexed attention.

It is the shared decoder (`model.GlmMoeDsaForCausalLM`: forward, hidden states, logits, next-n heads, statistics)
with its own layer loop (`_decoder`). Parameter names are the checkpoints' text-model names under `model.` (on disk
`model.language_model.`; see glm5_next/checkpoint.py). A cache must be a `HybridCache` (`new_cache()`), since KDA
layers keep state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openglm.model import fast
from openglm.model import model as base
from openglm.model.config import ModelConfig
from openglm.model.glm5_next.attention import IndexedAttention, PooledIndexer
from openglm.model.glm5_next.cache import HybridCache
from openglm.model.glm5_next.hyper_connections import HyperConnection, merge
from openglm.model.glm5_next.kda import LinearAttention, _GatedRMSNorm
from openglm.model.masks import key_validity
from openglm.model.moe import MLP, MoE
from openglm.model.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.linear = layer_idx, cfg.is_linear(layer_idx)
        self.self_attn = LinearAttention(cfg, layer_idx) if self.linear else IndexedAttention(cfg, layer_idx)
        self.mlp = MoE(cfg, layer_idx) if cfg.mlp_layer_types[layer_idx] == "sparse" else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(self, "hc_attn", *hc)
        self.ffn_hc = HyperConnection(self, "hc_ffn", *hc)

    def forward(self, streams, rot, key_valid, past: int, cache, prev_selection, token_mask, with_stats,
                ops: fast.Reference):
        """streams [B, T, n, hidden] -> (streams, DSA selection for a following 'shared' layer or None, MoE stats).
        The signature of the shared decoder layer (`rot` unused: no RoPE), which activation checkpointing relies on."""
        post, comb, x = self.attn_hc.weights(self, streams)
        x = ops.norm(self.input_layernorm, x)
        selection = None
        if self.linear:
            state = cache.linear_state(self.layer_idx) if cache is not None else None
            token_valid = None if key_valid is None else key_valid[:, past:]
            a, state = self.self_attn(x, state, token_valid, cache is not None, ops)
            if cache is not None:
                cache.set_linear_state(self.layer_idx, state)
        else:
            a, selection = self.self_attn(x, rot, key_valid, past, cache, prev_selection, ops)
        streams = merge(a, post, comb, streams)
        post, comb, x = self.ffn_hc.weights(self, streams)
        x = ops.norm(self.post_attention_layernorm, x)
        stats = None
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(x, token_mask, with_stats, cache, ops)
        else:
            m = self.mlp(x, ops)
        return merge(m, post, comb, streams), selection, stats


class Glm5NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mtp_layers = nn.ModuleList(base.NextNLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))


class Glm5NextForCausalLM(base.GlmMoeDsaForCausalLM):
    model_class = Glm5NextModel

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        # The vision tower's tensors of a multimodal checkpoint (HF name -> tensor): kept as stored, written back.
        self.vision_extra: dict[str, torch.Tensor] = {}

    def new_cache(self) -> HybridCache:
        return HybridCache()

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, LinearAttention):
                for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
                    conv.reset_parameters()
                if m.lower_bound is not None:  # the bounded gate's rate starts at 1 (A_log 0)
                    m.A_log.zero_()
                else:
                    m.A_log.uniform_(1.0, 16.0).log_()
                # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]: the gates start between slow and fast
                dt = torch.empty_like(m.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_(min=1e-4)
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif isinstance(m, _GatedRMSNorm):
                m.weight.fill_(1.0)
            elif isinstance(m, PooledIndexer):
                m.index_kpool_compress_ape.zero_()
                m.index_kpool_compress_gate.normal_(std=std)
            elif isinstance(m, DecoderLayer):
                for prefix in ("hc_attn", "hc_ffn"):
                    getattr(m, f"{prefix}_fn").normal_(std=std)
                    getattr(m, f"{prefix}_base").zero_()
                    getattr(m, f"{prefix}_scale").fill_(1.0)

    def _decoder(self, input_ids, attention_mask, position_ids, cache, with_stats: bool):
        """The streams through every layer, then their mean: (hidden [B, T, H] before the final norm, the MoE
        statistics or None, the position ids (they only place the next-n layer's inputs: no RoPE), the paths)."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        if cache is not None and not hasattr(cache, "linear_state"):
            raise TypeError(f"a glm5_next model keeps KDA state between forwards: pass model.new_cache() (a "
                            f"HybridCache), not a {type(cache).__name__}")
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.shape != (B, past + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, past + T)} "
                             "([batch, past + new tokens])")
        if position_ids is None:
            position_ids = base.default_position_ids(attention_mask, B, past, T, input_ids.device)
        key_valid = key_validity(attention_mask)
        token_mask = attention_mask[:, past:].reshape(-1).bool() if attention_mask is not None else None
        ops = fast.choose(input_ids, with_stats)  # no native decode step for this family
        h = self.model.embed_tokens(input_ids)
        streams = h.unsqueeze(2).expand(B, T, self.config.hc_mult, h.shape[-1]).contiguous()
        selection, layer_stats = None, []
        for layer in self.model.layers:
            dsa = layer.self_attn.kind == "dsa"
            if dsa and layer.self_attn.indexer is not None:
                selection = None  # a layer with its own indexer selects anew: free the old slots first
            streams, sel, stats = layer(streams, None, key_valid, past, cache, selection, token_mask, with_stats,
                                        ops)
            if dsa:
                selection = sel
            if stats is not None:
                layer_stats.append(stats)
        if cache is not None:
            cache.advance(T)
        h = streams.mean(2)
        return h, self._collect(layer_stats, h) if with_stats else None, position_ids, ops

    def _mtp_layer(self, hidden, next_ids, position_ids, attention_mask, cache, depth: int, with_stats: bool, ops):
        """Next-n layer `depth` without a cache (the MTP loss in training; the engine does not draft with it yet)."""
        if cache is not None:
            raise ValueError("glm5_next's next-n layer runs without a cache (the engine does not draft with it yet)")
        layer = self.model.mtp_layers[depth]
        key_valid = key_validity(attention_mask)
        token_mask = attention_mask.reshape(-1).bool() if attention_mask is not None else None
        x = layer.mix(self.model.embed_tokens(next_ids), hidden, position_ids, ops)
        x, _, stats = layer(x, None, key_valid, 0, None, None, token_mask, with_stats, ops)
        return x, self._collect([stats] if stats is not None else [], x) if with_stats else None
