"""The GLM decoder (`GlmMoeDsaForCausalLM`, for every model type of ModelConfig): embeddings, attention
(MLA/DSA for glm_moe_dsa, MLA for glm4_moe_lite, GQA for glm4_moe) + MoE layers, LM head, and the
checkpoint's next-n (MTP) layers, run by `mtp_forward` (the trainer's MTP loss, the engine's speculative drafts).

Parameter names equal transformers' on-disk names except the routed experts, which are stored
stacked, and the next-n layers, held as `model.mtp_layers.i` (on disk `model.layers.{num_hidden_layers + i}`;
see openglm/model/hf_names.py for the HF <-> native mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openglm.model.attention import MLAttention
from openglm.model.config import ModelConfig
from openglm.model.decode_step import DecodePlan
from openglm.model.errors import TokenIdError
from openglm.model.gqa import GQAttention
from openglm.model.masks import key_validity
from openglm.model.moe import MLP, MoE, Experts
from openglm.model.native import linear
from openglm.model.norm import RMSNorm
from openglm.model.rope import RotaryEmbedding
from openglm.model.router import Router


@dataclass
class MoEStats:
    aux_loss: torch.Tensor  # weighted sum of balance losses and z-loss over MoE layers
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # unweighted, summed over MoE layers
    expert_counts: torch.Tensor | None = None  # [n_moe_layers, n_routed_experts]
    dropped_fraction: float = 0.0  # assignments dropped by the capacity limit / all assignments


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, vocab]
    aux: MoEStats | None = None
    hidden: torch.Tensor | None = None  # [B, T, hidden] after the final norm (return_hidden=True): the MTP input
    mtp_logits: torch.Tensor | None = None  # [B, T-1, vocab]: next-n layer 0's prediction of token t+2 (return_mtp)


class LMHead(nn.Linear):
    """The output projection: an nn.Linear (same parameter, hooks and state_dict) whose fp32 decode
    steps compute W @ x^T: with a handful of rows, MKL's sgemm streams the big [vocab, hidden] weight
    ~1.7x faster as the left operand than as the transposed right one (bf16 runs through oneDNN, where
    the plain form is the faster one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # A decode step's rows through decode_kernels.c (streams the cold weight); beyond 2 bf16 rows oneDNN's
        # matmul wins (figures in docs/model.md, "Decode, issue 16").
        native_rows = 8 if x.dtype == torch.float32 else 2
        if (self.bias is None and x.dtype == self.weight.dtype and rows.shape[0] <= native_rows
                and not torch.is_grad_enabled()):
            return linear(x, self.weight)
        if (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and self.bias is None
                and rows.shape[0] <= 64 and not torch.is_grad_enabled()):
            return (self.weight @ rows.t()).t().contiguous().view(*x.shape[:-1], self.weight.shape[0])
        return super().forward(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = (GQAttention if cfg.model_type == "glm4_moe" else MLAttention)(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.mlp_layer_types[layer_idx] == "sparse" else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rot, key_valid, past, cache, prev_selection, token_mask, with_stats):
        a, selection = self.self_attn(self.input_layernorm(h), rot, key_valid, past, cache, prev_selection)
        h = h + a
        x = self.post_attention_layernorm(h)
        stats = None
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(x, token_mask, with_stats)
        else:
            m = self.mlp(x)
        return h + m, selection, stats


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NextNLayer(DecoderLayer):
    """One multi-token-prediction layer as GLM (DeepSeek-V3 style) checkpoints store it: a decoder layer
    (full indexer, MoE MLP) plus enorm/hnorm over the next token's embedding and the last hidden state,
    eh_proj mixing the two, and shared_head.norm before the (shared) LM head.

    Run as vLLM / SGLang run DeepSeek-V3 and GLM MTP weights: row j sees the main model's hidden state of
    position j *after* its final norm and the embedding of token j+1 (zeroed at position 0), concatenated
    as [enorm(embedding), hnorm(hidden)], at position j; its logits predict token j+2."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg.mtp_config(), cfg.num_hidden_layers + index)
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(cfg)

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        mixed = torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1)
        # Inference skips the module call, as o_proj does, so a draft step's rows take `linear`'s native path.
        return self.eh_proj(mixed) if torch.is_grad_enabled() else linear(mixed, self.eh_proj.weight)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.mtp_layers = nn.ModuleList(NextNLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))


class GlmMoeDsaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = GlmMoeDsaModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        # Optional copies some checkpoints store inside a next-n layer (its embed_tokens, shared_head.head):
        # kept as loaded (HF name -> tensor) and written back on save.
        self.mtp_extra: dict[str, torch.Tensor] = {}
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Experts):
                nn.init.normal_(m.gate_up_proj, std=std)
                nn.init.normal_(m.down_proj, std=std)
            elif isinstance(m, Router):
                nn.init.normal_(m.weight, std=std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, return_aux=False,
                logits_to_keep: int = 0, return_hidden: bool = False, return_mtp: bool = False,
                return_logits: bool = True):
        """logits_to_keep: compute the logits of only the last n positions (0 = all; as in transformers): a
        long prefill then skips the [T, vocab] matrix (2 GiB for 64K tokens of the small preset).
        return_hidden: also return every position's final-norm hidden state (what the MTP layer reads).
        return_mtp (training, no cache): also run next-n layer 0 over the sequence (inside forward, so FSDP's
        hooks cover it); its MoE aux loss joins `aux.aux_loss`. return_logits=False (with return_hidden): no LM
        head (speculative verification applies it to the positions it keeps)."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.shape != (B, past + T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, past + T)} "
                             "([batch, past + new tokens])")
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, B, past, T, input_ids.device)
        key_valid = key_validity(attention_mask)
        h = self.model.embed_tokens(input_ids)
        rot = self.model.rotary_emb(position_ids)
        token_mask = attention_mask[:, past:].reshape(-1).bool() if attention_mask is not None else None
        selection, layer_stats = None, []
        plan = DecodePlan.create(self.model.layers, cache, input_ids, attention_mask, return_aux, h.dtype)
        if plan is not None:  # a decode step's few rows: three native calls per layer (decode_step.py)
            plan.run_layers(self.model.layers, h, rot.rope)
        for layer in self.model.layers if plan is None else ():
            if layer.self_attn.indexer is not None:
                selection = None  # a layer with its own indexer selects anew: free the old slots ([B, T, k]) first
            h, sel, stats = layer(h, rot, key_valid, past, cache, selection, token_mask, return_aux)
            if layer.self_attn.kind == "dsa":
                selection = sel
            if stats is not None:
                layer_stats.append(stats)
        aux = self._collect(layer_stats, h) if return_aux else None
        if not (return_hidden or return_mtp):  # only the kept positions are normed
            return CausalLMOutput(self.lm_head(self.model.norm(h[:, -logits_to_keep:] if logits_to_keep else h)), aux)
        normed = self.model.norm(h)
        mtp_logits = None
        if return_mtp:
            if cache is not None or not self.model.mtp_layers:
                raise ValueError("return_mtp needs a model with next-n layers and no cache")
            mask = attention_mask[:, 1:] if attention_mask is not None else None
            mtp_logits, _, mtp_aux = self.mtp_forward(normed[:, :-1], input_ids[:, 1:], position_ids[:, :-1],
                                                      mask, None, 0, return_aux)
            if aux is not None:
                aux.aux_loss = aux.aux_loss + mtp_aux.aux_loss
        logits = None
        if return_logits:
            logits = self.lm_head(normed[:, -logits_to_keep:] if logits_to_keep else normed)
        return CausalLMOutput(logits, aux, normed if return_hidden else None, mtp_logits)

    def mtp_forward(self, hidden, next_ids, position_ids, attention_mask=None, cache=None, depth: int = 0,
                    return_aux: bool = False, return_logits: bool = True):
        """One next-n layer: `hidden` [B, T, H] is the main model's final-norm hidden state at `position_ids`
        (or, chaining drafts, this layer's own previous output), `next_ids` [B, T] the token after each
        position. Returns (logits [B, T, vocab] predicting the token after next (None unless return_logits),
        the layer's output hidden state for the next chained call, the MoE stats when return_aux). `cache` holds this layer's own KV
        (layer index num_hidden_layers + depth), in step with the main model's positions."""
        self._check_ids(next_ids)
        layer = self.model.mtp_layers[depth]
        B, T = next_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        key_valid = key_validity(attention_mask)
        token_mask = attention_mask[:, past:].reshape(-1).bool() if attention_mask is not None else None
        x = layer.mix(self.model.embed_tokens(next_ids), hidden, position_ids)
        rot = self.model.rotary_emb(position_ids)
        plan = DecodePlan.create([layer], cache, next_ids, attention_mask, return_aux, x.dtype)
        if plan is not None:
            x, stats = x.contiguous(), None
            plan.run_layers([layer], x, rot.rope)
        else:
            x, _, stats = layer(x, rot, key_valid, past, cache, None, token_mask, return_aux)
        logits = self.mtp_logits(x, depth) if return_logits else None
        return logits, x, (self._collect([stats] if stats is not None else [], x) if return_aux else None)

    def mtp_logits(self, mtp_hidden: torch.Tensor, depth: int = 0, head: torch.Tensor | None = None) -> torch.Tensor:
        """The shared LM head over a next-n layer's output (after that layer's shared_head.norm); `head`: another
        weight for it (the engine's drafts read an int8 copy)."""
        normed = self.model.mtp_layers[depth].shared_head.norm(mtp_hidden)
        return self.lm_head(normed) if head is None else linear(normed, head)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int, torch.int16, torch.uint8):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise TokenIdError(f"input_ids contains token id {bad}, outside the vocabulary [0, "
                                   f"{self.config.vocab_size})")

    def _collect(self, layer_stats, h) -> MoEStats:
        cfg = self.config
        zero = h.new_zeros((), dtype=torch.float32)
        if not layer_stats:
            return MoEStats(zero, {}, h.new_zeros((0, cfg.n_routed_experts), dtype=torch.long), 0.0)
        losses = {name: sum(s.losses[name] for s in layer_stats) for name in layer_stats[0].losses}
        aux = (cfg.cv_loss_coef * (losses["cv_importance"] + losses["cv_load"])
               + cfg.switch_loss_coef * losses["switch"] + cfg.z_loss_coef * losses["z"])
        assigned = sum(s.assigned for s in layer_stats)
        return MoEStats(aux + zero, losses, torch.stack([s.counts for s in layer_stats]),
                        sum(s.dropped for s in layer_stats) / max(assigned, 1))


def default_position_ids(attention_mask, B, past, T, device) -> torch.Tensor:
    """Positions count real tokens only (cumsum of the mask), so left padding does not shift them."""
    if attention_mask is None:
        return torch.arange(past, past + T, device=device).expand(B, T)
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)[:, past:]
