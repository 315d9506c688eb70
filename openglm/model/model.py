"""The GLM decoder (`GlmMoeDsaForCausalLM`, for every model family of ModelConfig): embeddings, the family's attention
(`families.py`: MLA/DSA for glm_moe_dsa, MLA for glm4_moe_lite, GQA for glm4_moe) + MoE layers, LM head, and the
checkpoint's next-n (MTP) layers.

Its entries:
- `forward(input_ids, attention_mask, position_ids, cache)`: the logits of every position (`CausalLMOutput`);
  training asks for what its loss needs: `aux=True`, the MoE statistics; `mtp=True`, next-n layer 0's logits
  (inside forward, so FSDP's hooks cover it).
- `hidden_states(...)`: every position's final-norm hidden state, no LM head; `logits(hidden)` then applies the head
  to the positions a caller keeps (speculative verification, a long prefill's last position).
- `mtp_forward(hidden, next_ids, ...)`: one next-n layer (the engine's speculative drafts), `mtp_logits` its logits.
- `save_pretrained(path, tokenizer=...)`: a Hugging Face checkpoint, tokenizer beside the weights (save.py).
Each entry picks its paths once (`fast.choose`): the reference path, or the inference fast paths.

Parameter names equal transformers' on-disk names except the routed experts, which are stored
stacked, and the next-n layers, held as `model.mtp_layers.i` (on disk `model.layers.{num_hidden_layers + i}`;
see openglm/model/hf_names.py for the HF <-> native mapping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openglm.model import fast
from openglm.model.config import ModelConfig
from openglm.model.errors import TokenIdError
from openglm.model.families import family_of
from openglm.model.masks import key_validity
from openglm.model.moe import MLP, Experts, MoE
from openglm.model.norm import RMSNorm
from openglm.model.rope import RotaryEmbedding
from openglm.model.router import Router
from openglm.model.save import save_pretrained as write_checkpoint


@dataclass
class MoEStats:
    aux_loss: torch.Tensor  # weighted sum of balance losses and z-loss over MoE layers
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # unweighted, summed over MoE layers
    expert_counts: torch.Tensor | None = None  # [n_moe_layers, n_routed_experts]
    dropped_fraction: float = 0.0  # assignments dropped by the capacity limit / all assignments


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, vocab]
    aux: MoEStats | None = None  # forward(..., aux=True)
    mtp_logits: torch.Tensor | None = None  # [B, T-1, vocab]: next-n layer 0's prediction of token t+2 (mtp=True)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = family_of(cfg.model_type).attention(cfg, layer_idx)
        self.mlp = MoE(cfg, layer_idx) if cfg.mlp_layer_types[layer_idx] == "sparse" else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rot, key_valid, past, cache, prev_selection, token_mask, with_stats, ops: fast.Reference):
        a, selection = self.self_attn(ops.norm(self.input_layernorm, h), rot, key_valid, past, cache, prev_selection,
                                      ops)
        h = h + a
        x = ops.norm(self.post_attention_layernorm, h)
        stats = None
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(x, token_mask, with_stats, cache, ops)
        else:
            m = self.mlp(x, ops)
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

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
            ops: fast.Reference) -> torch.Tensor:
        embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        mixed = torch.cat([ops.norm(self.enorm, embeds), ops.norm(self.hnorm, hidden.to(embeds.dtype))], dim=-1)
        return ops.linear(self.eh_proj, mixed)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.mtp_layers = nn.ModuleList(NextNLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))


class GlmMoeDsaForCausalLM(nn.Module):
    model_class = GlmMoeDsaModel  # the decoder stack; a model type with other layers subclasses with its own

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.family = family_of(config.model_type)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
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

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, *, aux: bool = False,
                mtp: bool = False) -> CausalLMOutput:
        """The logits of every position. Training asks for what its loss needs: `aux=True`, the MoE statistics
        (`CausalLMOutput.aux`); `mtp=True` (no cache), next-n layer 0 over the sequence (`mtp_logits`; inside
        forward, so FSDP's hooks cover it), whose MoE aux loss joins `aux.aux_loss`."""
        h, stats, position_ids, ops = self._decoder(input_ids, attention_mask, position_ids, cache, aux)
        normed = ops.norm(self.model.norm, h)
        mtp_logits = None
        if mtp:
            if cache is not None or not self.model.mtp_layers:
                raise ValueError("mtp=True needs a model with next-n layers and no cache")
            mask = attention_mask[:, 1:] if attention_mask is not None else None
            x, mtp_stats = self._mtp_layer(normed[:, :-1], input_ids[:, 1:], position_ids[:, :-1], mask, None, 0,
                                           aux, ops)
            mtp_logits = self._mtp_head(x, 0, None, ops)
            if stats is not None:
                stats.aux_loss = stats.aux_loss + mtp_stats.aux_loss
        return CausalLMOutput(ops.lm_head(self.lm_head, normed), stats, mtp_logits)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None, cache=None, last: int = 0):
        """Every position's hidden state after the final norm, [B, T, hidden], without the LM head: the input of
        `logits` (for the positions a caller keeps) and of the next-n layers (`mtp_forward`). `last=n`: the last n
        positions only (a long prefill then norms one row). Other arguments as forward."""
        h, _, _, ops = self._decoder(input_ids, attention_mask, position_ids, cache, False)
        return ops.norm(self.model.norm, h[:, -last:] if last else h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-norm hidden states [..., hidden] (from `hidden_states`): [..., vocab]."""
        return fast.choose(hidden).lm_head(self.lm_head, hidden)

    def mtp_forward(self, hidden, next_ids, position_ids, attention_mask=None, cache=None, depth: int = 0):
        """One next-n layer: `hidden` [B, T, H] is the main model's final-norm hidden state at `position_ids`
        (or, chaining drafts, this layer's own previous output), `next_ids` [B, T] the token after each
        position. Returns the layer's output hidden state [B, T, H]: `mtp_logits` gives its prediction of the token
        after next, and it is the input of the next chained call. `cache` holds this layer's own KV (layer index
        num_hidden_layers + depth), in step with the main model's positions."""
        self._check_ids(next_ids)
        layer = self.model.mtp_layers[depth]
        dtype = self.model.embed_tokens.weight.dtype
        ops = fast.choose(next_ids, decode_plan=lambda: self._decode_plan([layer], cache, next_ids, attention_mask,
                                                                           dtype))
        return self._mtp_layer(hidden, next_ids, position_ids, attention_mask, cache, depth, False, ops)[0]

    def mtp_logits(self, mtp_hidden: torch.Tensor, depth: int = 0, head: torch.Tensor | None = None) -> torch.Tensor:
        """The shared LM head over a next-n layer's output (after that layer's shared_head.norm); `head`: another
        weight for it (the engine's drafts read an int8 copy)."""
        return self._mtp_head(mtp_hidden, depth, head, fast.choose(mtp_hidden))

    def _decoder(self, input_ids, attention_mask, position_ids, cache, with_stats: bool):
        """The decoder layers over the embedded ids: (last hidden state [B, T, H] before the final norm, the MoE
        statistics or None, the position ids, the paths this call took)."""
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
        layers = self.model.layers
        ops = fast.choose(input_ids, with_stats,
                          lambda: self._decode_plan(layers, cache, input_ids, attention_mask, h.dtype))
        if ops.plan is not None:  # a decode step's few rows: three native calls per layer (glm5/decode_step.py)
            ops.plan.run_layers(layers, h, rot.rope)
            return h, None, position_ids, ops
        selection, layer_stats = None, []
        for layer in layers:
            if layer.self_attn.indexer is not None:
                selection = None  # a layer with its own indexer selects anew: free the old slots ([B, T, k]) first
            h, sel, stats = layer(h, rot, key_valid, past, cache, selection, token_mask, with_stats, ops)
            if layer.self_attn.kind == "dsa":
                selection = sel
            if stats is not None:
                layer_stats.append(stats)
        return h, self._collect(layer_stats, h) if with_stats else None, position_ids, ops

    def _mtp_layer(self, hidden, next_ids, position_ids, attention_mask, cache, depth: int, with_stats: bool, ops):
        """Next-n layer `depth` (see `mtp_forward`): (its output hidden state, its MoE statistics or None)."""
        layer = self.model.mtp_layers[depth]
        past = cache.get_seq_length() if cache is not None else 0
        key_valid = key_validity(attention_mask)
        token_mask = attention_mask[:, past:].reshape(-1).bool() if attention_mask is not None else None
        x = layer.mix(self.model.embed_tokens(next_ids), hidden, position_ids, ops)
        rot = self.model.rotary_emb(position_ids)
        if ops.plan is not None:
            x = x.contiguous()
            ops.plan.run_layers([layer], x, rot.rope)
            return x, None
        x, _, stats = layer(x, rot, key_valid, past, cache, None, token_mask, with_stats, ops)
        return x, self._collect([stats] if stats is not None else [], x) if with_stats else None

    def _mtp_head(self, mtp_hidden, depth: int, head, ops) -> torch.Tensor:
        normed = ops.norm(self.model.mtp_layers[depth].shared_head.norm, mtp_hidden)
        return ops.lm_head(self.lm_head, normed) if head is None else ops.linear_weight(normed, head)

    def _decode_plan(self, layers, cache, input_ids, attention_mask, dtype):
        """The family's native decode step over `layers`, when it has one and it applies (None otherwise)."""
        step = self.family.decode_step
        return None if step is None else step.create(layers, cache, input_ids, attention_mask, dtype)

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

    def save_pretrained(self, path, tokenizer=None, max_shard_size: int = 2 << 30, quantization=None):
        """Write this model as a Hugging Face checkpoint at `path` (transformers' method name); `tokenizer`: an
        openglm Tokenizer or a folder holding one, written beside the weights so the folder can be served. See
        openglm/model/save.py."""
        return write_checkpoint(self, path, max_shard_size=max_shard_size, quantization=quantization,
                                tokenizer=tokenizer)


def default_position_ids(attention_mask, B, past, T, device) -> torch.Tensor:
    """Positions count real tokens only (cumsum of the mask), so left padding does not shift them."""
    if attention_mask is None:
        return torch.arange(past, past + T, device=device).expand(B, T)
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)[:, past:]


def build_model(cfg: ModelConfig) -> GlmMoeDsaForCausalLM:
    """The causal LM of cfg's family (`GlmMoeDsaForCausalLM`, or the family's subclass: glm5_next's), on the current
    default device (weights initialised unless that is meta)."""
    family = family_of(cfg.model_type)
    return (family.causal_lm() if family.causal_lm is not None else GlmMoeDsaForCausalLM)(cfg)
