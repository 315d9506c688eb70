"""ModelConfig: the GLM-5 (`glm_moe_dsa`) shape plus openglm's routing/attention options.

Field names follow transformers' `GlmMoeDsaConfig` so a Hugging Face config.json maps 1:1;
options transformers does not know are saved under the `openglm` key of config.json.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from openglm.model.errors import ConfigError, UnknownModelTypeError
from openglm.model.presets import PRESETS

MODEL_TYPE = "glm_moe_dsa"
ATTENTION_KINDS = ("dsa", "dense", "local_global_random", "sliding_window")
ACTIVATIONS = ("silu", "gelu", "relu")
ROUTERS = ("sigmoid", "softmax")

# openglm-only options: written to config.json under "openglm", never as top-level HF keys.
OPENGLM_OPTIONS = (
    "attention_kinds", "sliding_window", "lgr_local_window", "lgr_global_stride", "lgr_random",
    "lgr_seed", "attn_query_chunk", "router", "cv_loss_coef", "switch_loss_coef", "z_loss_coef",
    "capacity_factor",
)
@dataclass
class ModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] | None = None  # "dense" | "sparse" per layer
    indexer_types: list[str] | None = None  # "full" | "shared" per layer
    # ---- openglm options ----
    attention_kinds: list[str] | None = None  # per layer, see ATTENTION_KINDS; default all "dsa"
    sliding_window: int = 4096
    lgr_local_window: int = 512
    lgr_global_stride: int = 64
    lgr_random: int = 64
    lgr_seed: int = 0
    attn_query_chunk: int | None = None  # queries per attention block (None: sized automatically)
    router: str = "sigmoid"  # "sigmoid" (GLM-5, bias-corrected, group-limited) | "softmax" (top-k gating)
    cv_loss_coef: float = 0.0  # Shazeer-2017 cv^2 importance + load loss
    switch_loss_coef: float = 0.0  # Switch/Mixtral load-balancing loss
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE)
    capacity_factor: float | None = None  # None: dropless; else per-expert capacity with token dropping

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if self.attention_kinds is None:
            self.attention_kinds = ["dsa"] * n
        self.rope_parameters = dict(self.rope_parameters or {})
        self.rope_parameters.setdefault("rope_type", "default")
        self.rope_parameters.setdefault("rope_theta", 10000.0)
        self.validate()

    # ---- derived sizes ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name in ("mlp_layer_types", "indexer_types", "attention_kinds"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is {n}")
        _check_values("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse"))
        _check_values("indexer_types", self.indexer_types, ("full", "shared"))
        _check_values("attention_kinds", self.attention_kinds, ATTENTION_KINDS)
        for i, (kind, itype) in enumerate(zip(self.attention_kinds, self.indexer_types)):
            if kind == "dsa" and itype == "shared" and not _has_full_before(self, i):
                raise ConfigError(f"indexer_types[{i}] is 'shared' but no earlier DSA layer runs a 'full' indexer")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads}: MLA expands one latent into every head")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (choose from {ACTIVATIONS})")
        if self.router not in ROUTERS:
            raise ConfigError(f"router={self.router!r} is not one of {ROUTERS}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        if self.moe_layers and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts]")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"index_head_dim={self.index_head_dim} < qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.index_head_dim % 2:
            raise ConfigError(f"index_head_dim={self.index_head_dim} must be even (the indexer head is rotated "
                              "as pairs: its rope slice by RoPE, the rest by 1)")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor} must be > 0 (or None for dropless)")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (default, yarn)")
        if rope_type == "yarn" and "factor" not in self.rope_parameters:
            raise ConfigError("rope_parameters.factor is required for rope_type 'yarn'")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "q_lora_rank", "index_topk", "index_n_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")

    # ---- presets and (de)serialisation ----
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r} (available: {', '.join(PRESETS)})")
        values = {**PRESETS[name], **overrides}
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict:
        """config.json content that transformers' GlmMoeDsaConfig reads (plus our options under 'openglm')."""
        out = {f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.name not in OPENGLM_OPTIONS}
        out["num_key_value_heads"] = self.num_attention_heads
        out.update(model_type=MODEL_TYPE, architectures=["GlmMoeDsaForCausalLM"])
        out["openglm"] = {name: _copy(getattr(self, name)) for name in OPENGLM_OPTIONS}
        return out

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            raise UnknownModelTypeError(f"model_type={model_type!r} is not supported (expected {MODEL_TYPE!r})")
        if d.get("quantization_config"):
            raise ConfigError("quantization_config: quantized checkpoints are not supported (dequantize first)")
        names = {f.name for f in fields(cls)}
        values = {k: _copy(v) for k, v in d.items() if k in names and k not in OPENGLM_OPTIONS}
        for alias in ("num_experts", "num_local_experts"):
            if d.get(alias) is not None:
                values["n_routed_experts"] = d[alias]
        values["rope_parameters"] = _rope_from_hf(d)
        if d.get("indexer_types") is None:
            values["indexer_types"] = _indexer_types_from_hf(d, values.get("num_hidden_layers", 78))
        extra = dict(d.get("openglm") or {})
        unknown = set(extra) - set(OPENGLM_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown key(s) under 'openglm' in config: {', '.join(sorted(unknown))}")
        values.update(extra)
        return cls(**values)


def _check_values(name, values, allowed):
    for i, v in enumerate(values):
        if v not in allowed:
            raise ConfigError(f"{name}[{i}]={v!r} is not one of {allowed}")


def _has_full_before(cfg, i):
    return any(cfg.attention_kinds[j] == "dsa" and cfg.indexer_types[j] == "full" for j in range(i))


def _copy(v):
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


def _rope_from_hf(d: dict) -> dict:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return rope


def _indexer_types_from_hf(d: dict, n: int) -> list[str]:
    """Same schedule as transformers: a pattern ('FSS...') wins, else the freq/offset rule."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
