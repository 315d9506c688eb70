"""ModelConfig: the GLM family's shapes plus openglm's routing/attention options.

One config, four Hugging Face model types that differ only by configuration:
- `glm_moe_dsa` (GLM-5): MLA + DeepSeek Sparse Attention + MoE;
- `glm4_moe_lite` (GLM-4.7-Flash): MLA + MoE, no indexer (every layer's attention kind is "dense");
- `glm4_moe` (GLM-4.5/4.5-Air/4.6/4.7): GQA attention (`head_dim`, partial RoPE, optional QK-norm) + MoE;
- `glm5_next` (GLM-5.3-Flash): per `layer_types`, Kimi-delta linear attention ("linear_attention") or NoPE MLA
  with a pooled-key DSA indexer ("indexed_attention"); hyper-connections (`hc_*`) around every block, a
  SwiGLU clamp (`swiglu_limit`). Its config.json nests the text fields under `text_config` (and the
  linear-attention ones, as transformers also reads them, under `linear_attn_config`).
Field names follow transformers' configs so a Hugging Face config.json maps 1:1; options transformers
does not know are saved under the `openglm` key of config.json. `to_hf_dict` also writes the keys vLLM and
SGLang read (see `engine_keys`), with values that make them compute what openglm computes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from openglm.model.errors import ConfigError, UnknownModelTypeError
from openglm.model.presets import PRESETS, TRANSFORMERS_DEFAULTS, preset_name

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "glm5_next": "Glm5NextForConditionalGeneration"}
MLA_TYPES = ("glm_moe_dsa", "glm4_moe_lite", "glm5_next")
DSA_TYPES = ("glm_moe_dsa", "glm5_next")
# Fields only some model types have (everything else is common to all three).
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim")
DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads", "indexer_types")
GQA_FIELDS = ("head_dim", "use_qk_norm")
GLM5_NEXT_FIELDS = ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                    "linear_lower_bound", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "index_kpool",
                    "index_kpool_always_select_tail", "swiglu_limit")
# The multimodal config's own keys (top level of a glm5_next config.json, beside text_config): kept and written back.
MULTIMODAL_FIELDS = ("vision_config", "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                     "video_start_token_id", "video_end_token_id")
LAYER_TYPES = ("linear_attention", "indexed_attention")
# Older names of the two layer kinds that transformers also accepts (and maps to these).
LAYER_TYPE_ALIASES = {"deepseek_sparse_attention": "indexed_attention", "full_attention": "indexed_attention",
                      "attention": "indexed_attention", "mamba": "linear_attention"}
# Tensors the model keeps in fp32 whatever its dtype (so a bf16 checkpoint may hold them in fp32).
FP32_TENSORS = ("e_score_correction_bias", "indexer.weights_proj.weight", "conv1d.weight", "dt_bias", "A_log",
                "hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")
# ... and that it loads into fp32 (the others take the requested dtype).
KEEP_FP32 = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "hc_attn_base", "hc_attn_scale",
             "hc_ffn_base", "hc_ffn_scale")
ATTENTION_KINDS = ("dsa", "dense", "local_global_random", "sliding_window")
ACTIVATIONS = ("silu", "gelu", "relu")
ROUTERS = ("sigmoid", "softmax")
ROUTER_CONTEXTS = ("none", "gated")  # "gated": the gate also reads a causal summary of the context (context_router.py)
ROUTER_CONTEXT_HEADS = 4  # the summary's channels share one decay and one write gate per group of dim / 4

# openglm-only options: written to config.json under "openglm", never as top-level HF keys.
OPENGLM_OPTIONS = (
    "attention_kinds", "sliding_window", "lgr_local_window", "lgr_global_stride", "lgr_random",
    "lgr_seed", "attn_query_chunk", "router", "cv_loss_coef", "switch_loss_coef", "z_loss_coef",
    "capacity_factor", "router_context", "router_context_dim", "router_context_window",
)
# The largest value each size may take: far beyond any published model, small enough that nothing openglm does per
# layer, expert or list element (the checks, a model built on the meta device) runs long before a weight is read.
# A config is untrusted input: a billion layers must be refused at once, not after minutes of list building.
MAX_LAYERS = 1024  # num_hidden_layers + num_nextn_predict_layers
LIMITS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "moe_intermediate_size": 1 << 18,
    "num_hidden_layers": MAX_LAYERS, "num_nextn_predict_layers": 16, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "n_shared_experts": 64, "n_routed_experts": 8192, "num_experts_per_tok": 8192,
    "n_group": 8192, "topk_group": 8192, "first_k_dense_replace": MAX_LAYERS, "kv_lora_rank": 1 << 16,
    "q_lora_rank": 1 << 16, "qk_rope_head_dim": 4096, "v_head_dim": 4096, "qk_nope_head_dim": 4096,
    "head_dim": 4096, "index_head_dim": 4096, "index_n_heads": 1024, "index_topk": 1 << 24,
    "max_position_embeddings": 1 << 24, "sliding_window": 1 << 24, "lgr_local_window": 1 << 24,
    "lgr_global_stride": 1 << 24, "lgr_random": 1 << 24, "attn_query_chunk": 1 << 24,
    "router_context_dim": 1 << 12, "router_context_window": 1 << 20,
    "linear_num_heads": 1024, "linear_head_dim": 4096, "linear_conv_kernel_dim": 64, "hc_mult": 64,
    "hc_sinkhorn_iters": 1000, "index_kpool": 1 << 16,
}
LAYER_LISTS = ("mlp_layer_types", "indexer_types", "attention_kinds", "layer_types")
MAX_ROPE_THETA = 3.4028234663852886e38  # RoPE's frequencies are powers of it in float32: beyond, they are inf


@dataclass
class ModelConfig:
    model_type: str = MODEL_TYPE  # one of ARCHITECTURES
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
    head_dim: int | None = None  # glm4_moe: per-head width (None: hidden_size // num_attention_heads)
    use_qk_norm: bool = False  # glm4_moe: RMSNorm on each query/key head before RoPE
    # MTP layers stored after the decoder layers (trained with the MTP loss, drafts for speculative decoding)
    num_nextn_predict_layers: int = 0
    # ---- glm5_next (GLM-5.3-Flash); defaults are transformers' Glm5NextTextConfig's ----
    layer_types: list[str] | None = None  # "linear_attention" (KDA) | "indexed_attention" (MLA + DSA) per layer
    linear_num_heads: int = 64  # KDA heads
    linear_head_dim: int = 128  # KDA key/value width per head (its state is head_dim x head_dim)
    linear_conv_kernel_dim: int = 4  # KDA's causal depthwise conv over q, k, v
    linear_lower_bound: float | None = -5.0  # KDA forget gate in (lower_bound, 0) per step; None: -exp(A) softplus
    hc_mult: int = 4  # hyper-connection residual streams
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16  # the DSA indexer scores groups of this many consecutive keys
    index_kpool_always_select_tail: bool = True  # ... and always keeps the keys of the current incomplete group
    swiglu_limit: float | None = None  # clamp of the SwiGLU gate (above) and up (both sides) projections
    vision_config: dict | None = None  # the vision tower's config (its weights are kept, not run)
    image_token_id: int | None = None
    video_token_id: int | None = None
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    video_start_token_id: int | None = None
    video_end_token_id: int | None = None
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
    router_context: str = "none"  # "gated": the router also reads a causal summary of the tokens before (off: GLM)
    router_context_dim: int = 32  # channels of that summary
    router_context_window: int = 32  # tokens the summary reaches back (the current one included)

    def __post_init__(self):
        check_sizes(self)  # before any per-layer or per-element work
        check_field_types(self)
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if self.attention_kinds is None:
            self.attention_kinds = ["dsa" if self.model_type in DSA_TYPES else "dense"] * n
        if self.model_type == "glm5_next":
            if self.layer_types is None:  # transformers' default: every fourth layer attends with DSA
                self.layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
            self.layer_types = [LAYER_TYPE_ALIASES.get(t, t) for t in self.layer_types]
            if self.swiglu_limit is None:  # transformers' Glm5NextTextConfig always clamps (default 10)
                self.swiglu_limit = 10.0
        self.rope_parameters = dict(self.rope_parameters or {})
        self.rope_parameters.setdefault("rope_type", "default")
        self.rope_parameters.setdefault("rope_theta", 10000.0)
        if self.model_type == "glm4_moe":
            self.rope_parameters.setdefault("partial_rotary_factor", 0.5)  # transformers' default for glm4_moe
        self.validate()

    # ---- derived sizes ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.mlp_layer_types) if t == "sparse"]

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_TYPES

    def is_linear(self, i: int) -> bool:
        """Whether layer i is a KDA linear-attention layer (glm5_next)."""
        return self.layer_types is not None and self.layer_types[i] == "linear_attention"

    def is_dsa(self, i: int) -> bool:
        """Whether layer i attends with DSA: an attention layer of kind 'dsa'."""
        return self.attention_kinds[i] == "dsa" and not self.is_linear(i)

    @property
    def gqa_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        """Width of the rotated slice of each query/key head: MLA's qk_rope_head_dim, or GQA's
        head_dim * partial_rotary_factor."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.gqa_head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    def mtp_config(self) -> "ModelConfig":
        """This config with the next-n layers appended as ordinary layers (full indexer, MoE MLP), which is
        how a next-n layer's decoder block is built."""
        k = self.num_nextn_predict_layers
        kind = "dsa" if self.model_type in DSA_TYPES else "dense"
        layer_types = None if self.layer_types is None else self.layer_types + ["indexed_attention"] * k
        return self.replace(num_hidden_layers=self.num_hidden_layers + k, num_nextn_predict_layers=0,
                            layer_types=layer_types, attention_kinds=self.attention_kinds + [kind] * k,
                            indexer_types=self.indexer_types + ["full"] * k,
                            mlp_layer_types=self.mlp_layer_types + ["sparse" if self.n_routed_experts else "dense"] * k)

    def validate(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise UnknownModelTypeError(f"model_type={self.model_type!r} is not supported "
                                        f"(supported: {', '.join(ARCHITECTURES)})")
        _check_ranges(self)
        n = self.num_hidden_layers
        for name in ("mlp_layer_types", "indexer_types", "attention_kinds"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is {n}")
        _check_values("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse"))
        _check_values("indexer_types", self.indexer_types, ("full", "shared"))
        _check_values("attention_kinds", self.attention_kinds, ATTENTION_KINDS)
        if self.model_type == "glm5_next":
            _check_glm5_next(self)
        else:
            for name in ("layer_types", "swiglu_limit"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}: model_type {self.model_type!r} has no such option (glm5_next has)")
        for i, itype in enumerate(self.indexer_types):
            if self.is_dsa(i) and itype == "shared" and not _has_full_before(self, i):
                raise ConfigError(f"indexer_types[{i}] is 'shared' but no earlier DSA layer runs a 'full' indexer")
        if self.is_mla and self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                f"{self.num_attention_heads}: MLA expands one latent into every head")
        if self.model_type not in DSA_TYPES and "dsa" in self.attention_kinds:
            raise ConfigError(f"attention_kinds: model_type {self.model_type!r} has no DSA indexer, so no layer "
                              "can be 'dsa'")
        if self.model_type == "glm4_moe":
            _check_gqa(self)
            k = min(self.first_k_dense_replace, n)
            if self.mlp_layer_types != ["dense"] * k + ["sparse"] * (n - k):
                raise ConfigError(f"mlp_layer_types: glm4_moe's MoE layers follow first_k_dense_replace={k}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (choose from {ACTIVATIONS})")
        if self.router not in ROUTERS:
            raise ConfigError(f"router={self.router!r} is not one of {ROUTERS}")
        if self.router_context not in ROUTER_CONTEXTS:
            raise ConfigError(f"router_context={self.router_context!r} is not one of {ROUTER_CONTEXTS}")
        if self.router_context_dim <= 0 or self.router_context_dim % ROUTER_CONTEXT_HEADS:
            raise ConfigError(f"router_context_dim={self.router_context_dim} must be a positive multiple of "
                              f"{ROUTER_CONTEXT_HEADS}")
        if self.router_context_window < 1:
            raise ConfigError(f"router_context_window={self.router_context_window} must be >= 1")
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
        if self.index_head_dim % 2 and self.model_type == "glm_moe_dsa":
            raise ConfigError(f"index_head_dim={self.index_head_dim} must be even (the indexer head is rotated "
                              "as pairs: its rope slice by RoPE, the rest by 1)")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor} must be > 0 (or None for dropless)")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (default, yarn)")
        if rope_type == "yarn" and "factor" not in self.rope_parameters:
            raise ConfigError("rope_parameters.factor is required for rope_type 'yarn'")
        for key in ("factor", "original_max_position_embeddings", "mscale", "mscale_all_dim", "beta_fast",
                    "beta_slow", "attention_factor"):
            value = self.rope_parameters.get(key)
            if value is not None and (not _is_type(value, "float") or value < 0):
                raise ConfigError(f"rope_parameters.{key}={value!r} must be a finite number >= 0")

    # ---- presets and (de)serialisation ----
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        key = preset_name(name)
        if key is None:
            raise ConfigError(f"unknown preset {name!r} (available: {', '.join(PRESETS)}; published names such as "
                              "GLM-5.1 or zai-org/GLM-4.7-FP8 name the preset of their shape)")
        values = {**PRESETS[key], **overrides}
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict:
        """config.json content: the keys transformers' config class of `model_type` reads, the keys vLLM's
        and SGLang's model code read (`engine_keys`), and openglm's options under 'openglm'."""
        if self.model_type == "glm5_next":
            return _glm5_next_hf_dict(self)
        skip = set(OPENGLM_OPTIONS) | {"model_type"} | set(GLM5_NEXT_FIELDS) | set(MULTIMODAL_FIELDS)
        if self.model_type == "glm4_moe":
            skip |= set(MLA_FIELDS) | set(DSA_FIELDS) | {"mlp_layer_types"}
        else:
            skip |= set(GQA_FIELDS) | (set(DSA_FIELDS) if self.model_type == "glm4_moe_lite" else set())
        out = {f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        if self.model_type == "glm4_moe":
            out["head_dim"] = self.gqa_head_dim
            out["partial_rotary_factor"] = self.rope_parameters["partial_rotary_factor"]
        out.update(engine_keys(self))
        out.update(model_type=self.model_type, architectures=[ARCHITECTURES[self.model_type]])
        out["openglm"] = {name: _copy(getattr(self, name)) for name in OPENGLM_OPTIONS}
        return out

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnknownModelTypeError(f"model_type={model_type!r} is not supported "
                                        f"(supported: {', '.join(ARCHITECTURES)})")
        top, d = d, _text_config(d) if model_type == "glm5_next" else d
        _check_engine_keys(d)
        names = {f.name for f in fields(cls)} - set(MULTIMODAL_FIELDS)
        if model_type == "glm5_next":  # its head_dim is transformers' RoPE width (0), not a GQA head's
            names -= set(GQA_FIELDS)
        else:  # e.g. GlmMoeDsaConfig writes layer_types (every layer attention): nothing these types choose
            names -= set(GLM5_NEXT_FIELDS)
        # Keys the file leaves out take the defaults of transformers' config class for this model type.
        values = {k: _copy(v) for k, v in TRANSFORMERS_DEFAULTS[model_type].items()}
        values.update({k: _copy(v) for k, v in d.items() if k in names and k not in OPENGLM_OPTIONS})
        values["model_type"] = model_type  # a glm5_next text_config says glm5_next_text
        for alias, name in (("num_experts", "n_routed_experts"), ("num_local_experts", "n_routed_experts"),
                            ("num_mtp_layers", "num_nextn_predict_layers")):
            if d.get(alias) is not None:
                values[name] = d[alias]
        values["rope_parameters"] = _rope_from_hf(d)
        n = values.get("num_hidden_layers", 78)
        if _is_type(n, "int") and not 0 < n <= MAX_LAYERS:  # the lists below have n entries: bound n first
            raise ConfigError(f"num_hidden_layers={n} must be in [1, {MAX_LAYERS}]")
        if model_type == "glm4_moe":  # transformers picks MoE layers by first_k_dense_replace
            k = values.get("first_k_dense_replace", 1)
            k = min(max(k, 0), n) if _is_type(k, "int") and _is_type(n, "int") else None  # its range: checked later
            values["mlp_layer_types"] = None if k is None else ["dense"] * k + ["sparse"] * (n - k)
        elif model_type == "glm4_moe_lite" and d.get("mlp_layer_types") is None and isinstance(n, int):
            values["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)  # transformers' default for the lite model
        if model_type in DSA_TYPES and d.get("indexer_types") is None and isinstance(n, int):
            values["indexer_types"] = _indexer_types_from_hf(d, n)
        if model_type == "glm5_next":
            values.update(_glm5_next_from_hf(top, d, n))
        extra = top.get("openglm") or {}
        if not isinstance(extra, dict):
            raise ConfigError(f"'openglm' in config must be an object, got {type(extra).__name__}")
        unknown = set(extra) - set(OPENGLM_OPTIONS)
        if unknown:
            raise ConfigError(f"unknown key(s) under 'openglm' in config: {', '.join(sorted(unknown))}")
        values.update(extra)
        return cls(**values)


# ---- the keys vLLM and SGLang read ------------------------------------------------------------------
# Derived from their model code (see tests/model/test_export.py for the files and commits): both read the
# MoE routing from topk_method/scoring_func (not from a router class), the DSA indexer-sharing schedule
# from index_topk_pattern (or index_topk_freq/index_skip_topk_offset), the indexer's RoPE layout from
# indexer_rope_interleave (vLLM defaults to NeoX halves), the next-n layers from num_nextn_predict_layers,
# the MoE layers from first_k_dense_replace/moe_layer_freq (not mlp_layer_types), and GQA's head width from
# head_dim.


def engine_keys(cfg: ModelConfig) -> dict:
    """The extra config.json keys vLLM/SGLang read, with the values that make them compute what openglm does."""
    if cfg.model_type == "glm5_next":  # NoPE, no RoPE keys; the published config also carries linear_attn_config
        return {"topk_method": "noaux_tc" if cfg.router == "sigmoid" else "greedy", "scoring_func": cfg.router,
                "num_nextn_predict_layers": cfg.num_nextn_predict_layers, "first_k_dense_replace": _leading_dense(cfg),
                "linear_attn_config": linear_attn_config(cfg)}
    out = {"topk_method": "noaux_tc" if cfg.router == "sigmoid" else "greedy",
           "scoring_func": cfg.router, "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
           "moe_layer_freq": 1, "rope_theta": cfg.rope_parameters["rope_theta"],
           "first_k_dense_replace": _leading_dense(cfg)}
    if cfg.rope_parameters.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in cfg.rope_parameters.items() if k != "rope_theta"}
    if cfg.model_type == "glm_moe_dsa":
        out.update(index_topk_pattern="".join("F" if t == "full" else "S" for t in cfg.indexer_types),
                   index_topk_freq=1, index_skip_topk_offset=0, indexer_rope_interleave=True)
    if cfg.model_type == "glm4_moe_lite":
        out["rope_interleave"] = True
    return out


def _leading_dense(cfg: ModelConfig) -> int:
    k = 0
    while k < cfg.num_hidden_layers and cfg.mlp_layer_types[k] == "dense":
        k += 1
    return k


def export_warnings(cfg: ModelConfig) -> list[str]:
    """What vLLM/SGLang cannot reproduce of this config (they would load it and compute something else)."""
    out = []
    k = _leading_dense(cfg)
    if "dense" in cfg.mlp_layer_types[k:]:
        out.append(f"mlp_layer_types {cfg.mlp_layer_types} is not dense layers then MoE layers (the engines choose "
                   "MoE layers by first_k_dense_replace)")
    expected = "dsa" if cfg.model_type in DSA_TYPES else "dense"
    if any(kind != expected for kind in cfg.attention_kinds):
        out.append(f"attention_kinds {sorted(set(cfg.attention_kinds))}: the engines run every layer as '{expected}'")
    if cfg.router != "sigmoid":
        out.append(f"router={cfg.router!r}: the engines' GLM models route with sigmoid + e_score_correction_bias")
    if cfg.capacity_factor is not None:
        out.append("capacity_factor: the engines never drop tokens")
    if cfg.router_context != "none":
        out.append(f"router_context={cfg.router_context!r}: the engines' GLM routers read the hidden state only")
    if cfg.hidden_act != "silu":
        out.append(f"hidden_act={cfg.hidden_act!r}: the engines support silu only")
    if cfg.tie_word_embeddings:
        out.append("tie_word_embeddings: the engines' GLM models load a separate lm_head.weight")
    return out


def _check_engine_keys(d: dict) -> None:
    """Keys written for the engines that, if a file sets them otherwise, mean a model openglm does not compute."""
    for key, allowed in (("topk_method", ("noaux_tc", "greedy", None)), ("scoring_func", ("sigmoid", "softmax", None)),
                         ("indexer_rope_interleave", (True, None)), ("rope_interleave", (True, None))):
        if d.get(key) not in allowed:
            raise ConfigError(f"{key}={d.get(key)!r} is not supported (openglm computes {allowed[0]!r})")
    if d.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={d['moe_layer_freq']!r} is not supported (only 1)")


# ---- field types and ranges ---------------------------------------------------------------------------

_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "dict": dict, "None": type(None)}


def check_sizes(cfg: ModelConfig) -> None:
    """The sizes everything else is built from, checked in time independent of them: each an int within LIMITS (a
    float or a string is left to check_field_types), the layer count with its next-n layers within MAX_LAYERS,
    and each per-layer list as long as the layer count (before any of its elements is looked at)."""
    for name, limit in LIMITS.items():
        value = getattr(cfg, name)
        if _is_type(value, "int") and value > limit:
            raise ConfigError(f"{name}={value} is beyond what openglm accepts (at most {limit:,})")
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    if _is_type(n, "int") and _is_type(k, "int") and n + k > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers={n} + num_nextn_predict_layers={k} is beyond what openglm accepts "
                          f"(at most {MAX_LAYERS} layers)")
    for name in LAYER_LISTS:
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, list):
            raise ConfigError(f"{name}={_short(value)}: expected a list of one entry per layer")
        if value is not None and _is_type(n, "int") and len(value) != n:
            raise ConfigError(f"{name} has {len(value)} entries, num_hidden_layers is {n}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text):,} characters)"


def check_field_types(cfg: ModelConfig) -> None:
    """Each field holds a value of its annotated type (a JSON string "64" or "false" is not an int or a bool)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not any(_is_type(value, alt.strip()) for alt in str(f.type).split("|")):
            raise ConfigError(f"{f.name}={_short(value)}: expected {f.type}, got {type(value).__name__}")


def _is_type(value, name: str) -> bool:
    if name.startswith("list["):
        inner = name[5:-1]
        return isinstance(value, list) and all(_is_type(v, inner) for v in value)
    if isinstance(value, bool) and name in ("int", "float"):
        return False
    if name == "float" and isinstance(value, (int, float)) and not math.isfinite(value):
        return False
    return isinstance(value, _TYPES[name])


def _check_ranges(cfg: ModelConfig) -> None:
    positive = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "num_experts_per_tok",
                "n_routed_experts", "moe_intermediate_size", "n_group", "topk_group", "routed_scaling_factor"]
    if cfg.is_mla:
        positive += ["kv_lora_rank", "q_lora_rank", "v_head_dim"]
        positive.append("qk_nope_head_dim" if cfg.model_type == "glm5_next" else "qk_rope_head_dim")  # NoPE: rope 0
    if cfg.model_type in DSA_TYPES:
        positive += ["index_topk", "index_n_heads", "index_head_dim"]
    if cfg.model_type == "glm5_next":
        positive += ["linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters",
                     "index_kpool"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be > 0")
    for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers", "initializer_range",
                 "qk_nope_head_dim", "sliding_window", "lgr_local_window", "lgr_global_stride", "lgr_random", "hc_eps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.attn_query_chunk is not None and cfg.attn_query_chunk < 1:
        raise ConfigError(f"attn_query_chunk={cfg.attn_query_chunk} must be >= 1 (or null: sized automatically)")
    theta = cfg.rope_parameters.get("rope_theta")
    if not _is_type(theta, "float") or not 0 < theta <= MAX_ROPE_THETA:
        raise ConfigError(f"rope_parameters.rope_theta={theta!r} must be a number in (0, {MAX_ROPE_THETA:.3g}] (RoPE's "
                          "frequencies are its powers in float32)")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(cfg, name)
        for i in ids if isinstance(ids, list) else [] if ids is None else [ids]:
            if not 0 <= i < cfg.vocab_size:
                raise ConfigError(f"{name}={ids!r} is outside the vocabulary [0, {cfg.vocab_size})")


def _check_gqa(cfg: ModelConfig) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads={cfg.num_key_value_heads}")
    prf = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
    if not _is_type(prf, "float") or not 0 < prf <= 1:
        raise ConfigError(f"partial_rotary_factor={prf!r} must be in (0, 1]")
    if cfg.gqa_head_dim <= 0 or cfg.rope_dim % 2 or cfg.rope_dim == 0:
        raise ConfigError(f"head_dim={cfg.gqa_head_dim} x partial_rotary_factor={prf} gives a rotary width of "
                          f"{cfg.rope_dim}: it must be even and > 0")


def _check_values(name, values, allowed):
    for i, v in enumerate(values):
        if v not in allowed:
            raise ConfigError(f"{name}[{i}]={v!r} is not one of {allowed}")


def _has_full_before(cfg, i):
    return any(cfg.is_dsa(j) and cfg.indexer_types[j] == "full" for j in range(i))


# ---- glm5_next ------------------------------------------------------------------------------------


def _check_glm5_next(cfg: ModelConfig) -> None:
    n = cfg.num_hidden_layers
    if len(cfg.layer_types) != n:
        raise ConfigError(f"layer_types has {len(cfg.layer_types)} entries, num_hidden_layers is {n}")
    _check_values("layer_types", cfg.layer_types, LAYER_TYPES)
    if cfg.qk_rope_head_dim != 0:
        raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim}: glm5_next's attention has no RoPE (must be 0)")
    if cfg.index_topk % cfg.index_kpool:
        raise ConfigError(f"index_topk={cfg.index_topk} is not a multiple of index_kpool={cfg.index_kpool} (the "
                          "indexer keeps index_topk / index_kpool key groups)")
    if not cfg.swiglu_limit > 0:
        raise ConfigError(f"swiglu_limit={cfg.swiglu_limit!r} must be > 0 (glm5_next clamps its SwiGLUs)")
    if cfg.linear_lower_bound is not None and cfg.linear_lower_bound >= 0:
        raise ConfigError(f"linear_lower_bound={cfg.linear_lower_bound} must be < 0 (a forget gate in (bound, 0)) "
                          "or null")


def linear_attn_config(cfg: ModelConfig) -> dict:
    """The `linear_attn_config` block of a glm5_next config.json (as the published config carries it)."""
    out = {"num_heads": cfg.linear_num_heads, "head_dim": cfg.linear_head_dim,
           "short_conv_kernel_size": cfg.linear_conv_kernel_dim, "gate_lower_bound": cfg.linear_lower_bound,
           "kda_layers": [i for i in range(cfg.num_hidden_layers) if cfg.is_linear(i)],
           "full_attn_layers": [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)]}
    if cfg.linear_lower_bound is None:  # transformers reads a null bound as -5 unless safe_gate is false
        out["safe_gate"] = False
    return out


def _glm5_next_hf_dict(cfg: ModelConfig) -> dict:
    """A glm5_next config.json: the multimodal keys at the top, the text model's under text_config."""
    skip = (set(OPENGLM_OPTIONS) | set(MULTIMODAL_FIELDS) | set(GQA_FIELDS)
            | {"model_type", "rope_parameters", "first_k_dense_replace", "tie_word_embeddings"})
    text = {f.name: _copy(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in skip}
    text.update(engine_keys(cfg), model_type="glm5_next_text")
    out = {"architectures": [ARCHITECTURES["glm5_next"]], "model_type": "glm5_next", "text_config": text,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    out.update({name: _copy(getattr(cfg, name)) for name in MULTIMODAL_FIELDS if getattr(cfg, name) is not None})
    out["openglm"] = {name: _copy(getattr(cfg, name)) for name in OPENGLM_OPTIONS}
    return out


def _text_config(d: dict) -> dict:
    """A glm5_next config.json's text fields: its text_config, or (a flat, text-only file) the file itself."""
    text = d.get("text_config")
    if text is None:
        return d
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
    return text


def _glm5_next_from_hf(top: dict, text: dict, n) -> dict:
    """The glm5_next values transformers derives rather than reads: linear_attn_config's entries, the default MLP
    schedule, the top-level multimodal keys."""
    out = {}
    lin = text.get("linear_attn_config")
    if lin is not None:
        if not isinstance(lin, dict):
            raise ConfigError(f"linear_attn_config must be an object, got {type(lin).__name__}")
        for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                          ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                          ("gate_lower_bound", "linear_lower_bound")):
            if key in lin:
                out[name] = lin[key]
        if lin.get("safe_gate", True) and out.get("linear_lower_bound", text.get("linear_lower_bound", -5.0)) is None:
            out["linear_lower_bound"] = -5.0
    if text.get("mlp_layer_types") is None and isinstance(n, int):
        out["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    if "tie_word_embeddings" in top:
        out["tie_word_embeddings"] = top["tie_word_embeddings"]
    out.update({name: _copy(top[name]) for name in MULTIMODAL_FIELDS if name in top})
    return out


def _copy(v):
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


def _rope_from_hf(d: dict) -> dict:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters must be an object, got {type(rope).__name__}")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in d:
        rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    return rope


def _indexer_types_from_hf(d: dict, n: int) -> list[str]:
    """Same schedule as transformers: a pattern ('FSS...') wins, else the freq/offset rule."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(f"index_topk_pattern={_short(pattern)} must be a string of 'F' and 'S'")
        if len(pattern) != n:  # before looking at its characters: a pattern may be 10^8 of them
            raise ConfigError(f"index_topk_pattern has {len(pattern):,} characters, num_hidden_layers is {n}: one "
                              "'F' or 'S' per layer")
        if set(pattern) - {"F", "S"}:
            raise ConfigError(f"index_topk_pattern={_short(pattern)} must be a string of 'F' and 'S'")
        return [{"F": "full", "S": "shared"}[c] for c in pattern]
    freq, offset = d.get("index_topk_freq", 1), d.get("index_skip_topk_offset", 2)
    if not _is_type(freq, "int") or not _is_type(offset, "int"):
        raise ConfigError(f"index_topk_freq={freq!r} / index_skip_topk_offset={offset!r} must be integers")
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
