"""Parameter accounting: total, active per token, per-component breakdown, weight memory.

The model is built on the `meta` device, so even the 744B glm-5 shape costs no memory.
"Active" counts every parameter a token touches: all dense parts (embeddings, attention, indexer,
dense MLPs, shared experts, router, norms, LM head) plus `num_experts_per_tok` of the routed experts.
"""

from __future__ import annotations

import torch

from openglm.model.config import ModelConfig
from openglm.model.model import GlmMoeDsaForCausalLM

COMPONENTS = (  # (name, predicate on the parameter name), first match wins
    ("mtp (next-n)", lambda n: ".mtp_layers." in n),
    ("embeddings", lambda n: n.startswith("model.embed_tokens")),
    ("lm_head", lambda n: n.startswith("lm_head")),
    ("dsa_indexer", lambda n: ".indexer." in n),
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
        model = GlmMoeDsaForCausalLM(cfg)
    breakdown = {name: 0 for name, _ in COMPONENTS}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied embeddings count once
            continue
        seen.add(id(p))
        component = next(c for c, match in COMPONENTS if match(name))
        breakdown[component] += p.numel()
    total = sum(breakdown.values())
    n_moe = len(cfg.moe_layers)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    # The next-n layers run only when the engine drafts with them: not active in a plain forward.
    inactive += breakdown["mtp (next-n)"]
    active = total - inactive
    return {
        "total_params": total,
        "active_params": active,
        "breakdown": breakdown,
        "active_routed_experts": breakdown["routed_experts"] - n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok)
        * per_expert,
        "weight_memory_gib": {k: total * b / 2**30 for k, b in BYTES_PER_PARAM.items()},
        "layers": {"total": cfg.num_hidden_layers, "dense_mlp": cfg.num_hidden_layers - n_moe, "moe": n_moe},
    }


def format_report(name: str, cfg: ModelConfig, r: dict) -> str:
    if cfg.is_mla:
        attn = (f"  MLA q_lora {cfg.q_lora_rank} kv_lora {cfg.kv_lora_rank} qk {cfg.qk_nope_head_dim}+"
                f"{cfg.qk_rope_head_dim} v {cfg.v_head_dim}")
        if cfg.model_type == "glm_moe_dsa":
            attn += f"; DSA top-{cfg.index_topk} ({cfg.index_n_heads} heads x {cfg.index_head_dim})"
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
    return "\n".join(lines)


def _gib(v: float) -> str:
    return f"{v:,.1f} GiB" if v >= 1 else f"{v * 1024:,.1f} MiB"


def _fmt(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{unit})"
    return f"{n:,}"
