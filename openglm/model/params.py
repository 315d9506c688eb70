"""Parameter accounting: total, active per token, per-component breakdown, weight memory.

The model is built on the `meta` device, so even the 744B glm-5 shape costs no memory.
"Active" counts every parameter a token touches: all dense parts (embeddings, attention, indexer,
dense MLPs, shared experts, router, norms, LM head) plus `num_experts_per_tok` of the routed experts.
"""

from __future__ import annotations

import torch

from openglm.model.config import ModelConfig
from openglm.model.model import build_model

COMPONENTS = (  # (name, predicate on the parameter name), first match wins; see `_component`
    ("mtp (next-n)", lambda n: ".mtp_layers." in n),
    ("embeddings", lambda n: n.startswith("model.embed_tokens")),
    ("lm_head", lambda n: n.startswith("lm_head")),
    ("dsa_indexer", lambda n: ".indexer." in n),
    ("linear_attn (KDA)", lambda n: False),  # glm5_next's linear-attention layers, told by layer index
    ("hyper_connections", lambda n: ".hc_" in n),
    ("attention", lambda n: ".self_attn." in n),
    ("routed_experts", lambda n: ".mlp.experts." in n),
    ("shared_experts", lambda n: ".mlp.shared_experts." in n),
    ("router", lambda n: ".mlp.gate." in n),
    ("dense_mlp", lambda n: ".mlp." in n),
    ("norms", lambda n: True),
)
BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}


def parameter_report(cfg: ModelConfig) -> dict:
    with torch.device("meta"):
        model = build_model(cfg)
    breakdown = {name: 0 for name, _ in COMPONENTS}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied embeddings count once
            continue
        seen.add(id(p))
        breakdown[_component(name, cfg)] += p.numel()
    total = sum(breakdown.values())
    n_moe = len(cfg.moe_layers)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    # The next-n layers run only when the engine drafts with them: not active in a plain forward.
    inactive += breakdown["mtp (next-n)"]
    active = total - inactive
    if cfg.model_type != "glm5_next":
        breakdown = {k: v for k, v in breakdown.items() if k not in ("linear_attn (KDA)", "hyper_connections")}
    return {
        "total_params": total,
        "active_params": active,
        "breakdown": breakdown,
        "active_routed_experts": breakdown["routed_experts"] - n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok)
        * per_expert,
        "weight_memory_gib": {k: total * b / 2**30 for k, b in BYTES_PER_PARAM.items()},
        "layers": {"total": cfg.num_hidden_layers, "dense_mlp": cfg.num_hidden_layers - n_moe, "moe": n_moe},
        "cache": cache_sizes(cfg),
    }


def _component(name: str, cfg: ModelConfig) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[3] == "self_attn" and cfg.is_linear(int(parts[2])):
        return "linear_attn (KDA)"
    return next(c for c, match in COMPONENTS if match(name))


def cache_sizes(cfg: ModelConfig) -> dict:
    """What inference keeps besides the weights (bf16 cache entries, fp32 KDA state): bytes per token of context
    (MLA layers: the latent, plus each own indexer's keys, and its pooling scores for glm5_next) and bytes per
    sequence whatever its length (glm5_next's KDA layers: a [heads, d, d] state and the conv window)."""
    n = cfg.num_hidden_layers
    if not cfg.is_mla:
        return {"bytes_per_token": n * 2 * cfg.num_key_value_heads * cfg.gqa_head_dim * 2, "bytes_per_sequence": 0}
    attention = [i for i in range(n) if not cfg.is_linear(i)]
    own = [i for i in attention if cfg.is_dsa(i) and cfg.indexer_types[i] == "full"]
    per_index_key = cfg.index_head_dim * (2 if cfg.model_type == "glm5_next" else 1)
    per_token = 2 * (len(attention) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + len(own) * per_index_key)
    linear = n - len(attention)
    width = cfg.linear_num_heads * cfg.linear_head_dim
    per_sequence = linear * (4 * cfg.linear_num_heads * cfg.linear_head_dim ** 2
                             + 2 * 3 * width * (cfg.linear_conv_kernel_dim - 1)) if linear else 0
    return {"bytes_per_token": per_token, "bytes_per_sequence": per_sequence}


def format_report(name: str, cfg: ModelConfig, r: dict) -> str:
    if cfg.is_mla:
        attn = (f"  MLA q_lora {cfg.q_lora_rank} kv_lora {cfg.kv_lora_rank} qk {cfg.qk_nope_head_dim}+"
                f"{cfg.qk_rope_head_dim} v {cfg.v_head_dim}")
        if cfg.model_type == "glm_moe_dsa":
            attn += f"; DSA top-{cfg.index_topk} ({cfg.index_n_heads} heads x {cfg.index_head_dim})"
        if cfg.model_type == "glm5_next":
            linear = sum(cfg.is_linear(i) for i in range(cfg.num_hidden_layers))
            attn += (f" (no RoPE); DSA top-{cfg.index_topk} in groups of {cfg.index_kpool} ({cfg.index_n_heads} "
                     f"heads x {cfg.index_head_dim}) in {cfg.num_hidden_layers - linear} layers\n"
                     f"  KDA linear attention {cfg.linear_num_heads} heads x {cfg.linear_head_dim} (conv "
                     f"{cfg.linear_conv_kernel_dim}) in {linear} layers; hyper-connections x{cfg.hc_mult}; "
                     f"SwiGLU clamp {cfg.swiglu_limit:g}")
    else:
        attn = (f"  GQA {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads x {cfg.gqa_head_dim}, "
                f"RoPE on {cfg.rope_dim} dims, QK-norm {'on' if cfg.use_qk_norm else 'off'}, "
                f"bias {'on' if cfg.attention_bias else 'off'}")
    lines = [f"openglm model: {name} ({cfg.model_type})",
             f"  layers {cfg.num_hidden_layers} ({r['layers']['dense_mlp']} dense MLP, {r['layers']['moe']} MoE)"
             + (f" + {cfg.num_nextn_predict_layers} next-n (MTP)" if cfg.num_nextn_predict_layers else "")
             + f", hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, vocab {cfg.vocab_size}, "
             f"max positions {cfg.max_position_embeddings}",
             attn,
             f"  MoE {cfg.n_routed_experts} routed (top-{cfg.num_experts_per_tok}) + {cfg.n_shared_experts} shared, "
             f"router {cfg.router}, groups {cfg.n_group}/{cfg.topk_group}",
             "",
             f"  {'component':<18}{'parameters':>28}{'share':>8}"]
    total = r["total_params"]
    for comp, n in r["breakdown"].items():
        lines.append(f"  {comp:<18}{_fmt(n):>28}{100 * n / total:>7.1f}%")
    lines += [f"  {'total':<18}{_fmt(total):>28}",
              f"  {'active / token':<18}{_fmt(r['active_params']):>28}{100 * r['active_params'] / total:>7.1f}%",
              "",
              "  weight memory: " + ", ".join(f"{k} {_gib(v)}" for k, v in r["weight_memory_gib"].items())]
    cache = r["cache"]
    line = f"  cache (bf16): {_gib(cache['bytes_per_token'] / 2**30)} per token of context"
    if cache["bytes_per_sequence"]:
        line += f" + {_gib(cache['bytes_per_sequence'] / 2**30)} of KDA state per sequence (fp32, any length)"
    lines.append(line + f"; {_gib(cache['bytes_per_token'] * 131072 / 2**30)} at 128K tokens")
    return "\n".join(lines)


def _gib(v: float) -> str:
    if v >= 1:
        return f"{v:,.1f} GiB"
    return f"{v * 1024:,.1f} MiB" if v * 1024 >= 1 else f"{v * 2**20:,.1f} KiB"


def _fmt(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{unit})"
    return f"{n:,}"
