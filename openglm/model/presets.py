"""Model presets, as data. `ModelConfig.from_preset(name, **overrides)` builds a config from one.

- tiny:  unit tests (a forward takes milliseconds).
- small: the CPU demo scale (~14M parameters; trains in minutes on 2 cores).
- medium: GLM-5's shape scaled to one CPU box for inference benchmarks (~1.4B total, ~0.3B active): GLM-5's
  head dimensions (MLA qk 192+64, v 256, kv_lora 512; indexer 128-wide), 64 routed experts top-8 + 1 shared.
- glm-5: the published GLM-5 shape (transformers' GlmMoeDsaConfig defaults): ~744B total, ~40B active.
- glm-4.5, glm-4.5-air, glm-4.6, glm-4.7 (`glm4_moe`, GQA) and glm-4.7-flash (`glm4_moe_lite`, MLA without
  DSA): the shapes of zai-org's published config.json files.
- tiny-glm4-moe, tiny-glm4-moe-lite: unit-test sizes of the two other model types.
- glm-5.3-flash (`glm5_next`): the published GLM-5.3-Flash text shape (45 layers: KDA linear attention in three of
  every four, NoPE MLA + pooled DSA in the fourth; hyper-connections x4; 288 routed experts top-8 + 1 shared; one
  next-n layer). tiny-glm5-next: its unit-test size, every layer kind present.

TRANSFORMERS_DEFAULTS holds, per model type, the defaults of transformers 5.23.0's config class where they
differ from ModelConfig's (which are GlmMoeDsaConfig's): a config.json that leaves a key out gets these.
"""

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0,
        index_topk=8, index_head_dim=16, index_n_heads=4, indexer_types=["full", "shared", "full"],
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "small": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0,
        index_topk=128, index_head_dim=32, index_n_heads=4,
        indexer_types=["full", "full", "shared", "full", "shared", "full"],
        max_position_embeddings=4096, num_nextn_predict_layers=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "medium": dict(
        vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5,
        index_topk=2048, index_head_dim=128, index_n_heads=8,
        max_position_embeddings=65536, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # transformers 5.23.0 GlmMoeDsaConfig defaults (zai-org/GLM-5).
    "glm-5": dict(),
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_qk_norm=True,
        attention_bias=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    "tiny-glm4-moe-lite": dict(
        model_type="glm4_moe_lite", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.8, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # zai-org/GLM-4.5 (355B total, 32B active).
    "glm-4.5": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, use_qk_norm=True, attention_bias=True, n_routed_experts=160, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
        max_position_embeddings=131072, rms_norm_eps=1e-5, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        bos_token_id=None, eos_token_id=[151329, 151336, 151338], pad_token_id=151329,
    ),
    # zai-org/GLM-4.7-Flash (glm4_moe_lite: MLA + MoE, ~30B total, ~3B active).
    "glm-4.7-flash": dict(
        model_type="glm4_moe_lite", vocab_size=154880, hidden_size=2048, intermediate_size=10240,
        moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20,
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.8, max_position_embeddings=202752,
        num_nextn_predict_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=0, eos_token_id=[154820, 154827, 154829], pad_token_id=154820,
    ),
    # zai-org/GLM-5.3-Flash's text_config (config.json as quoted by third-party loaders; transformers 5.23.0's
    # Glm5NextTextConfig defaults for the rest): ~320B total, ~18B active as published.
    "glm-5.3-flash": dict(
        model_type="glm5_next", vocab_size=154880, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=45, num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256,
        n_routed_experts=288, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=3, routed_scaling_factor=2.5, rms_norm_eps=1e-5, max_position_embeddings=1048576,
        index_topk=2048, index_head_dim=128, index_n_heads=32, index_kpool=4, index_kpool_always_select_tail=True,
        layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=10.0, num_nextn_predict_layers=1,
        bos_token_id=None, eos_token_id=[154820, 154827, 154829], pad_token_id=154820,
    ),
    # Every glm5_next layer kind: KDA, DSA with its own and with a shared indexer, dense and MoE MLPs, 2 streams,
    # groups of 4 keys (index_topk 8 keeps 2 groups plus the incomplete tail group).
    "tiny-glm5-next": dict(
        model_type="glm5_next", vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=4096,
        index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                     "indexed_attention"],
        indexer_types=["full", "full", "shared", "full", "full"], mlp_layer_types=["dense"] + ["sparse"] * 4,
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, hc_mult=2, swiglu_limit=10.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
}
# zai-org/GLM-4.5-Air (106B total, 12B active): GLM-4.5 narrower and shallower, without QK-norm.
PRESETS["glm-4.5-air"] = {**PRESETS["glm-4.5"], "hidden_size": 4096, "intermediate_size": 10944,
                          "moe_intermediate_size": 1408, "num_hidden_layers": 46, "use_qk_norm": False,
                          "n_routed_experts": 128, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0}
# GLM-4.6 and GLM-4.7 keep GLM-4.5's layers and widen the context to 200K.
PRESETS["glm-4.6"] = {**PRESETS["glm-4.5"], "max_position_embeddings": 202752}
PRESETS["glm-4.7"] = dict(PRESETS["glm-4.6"])

# What users type for the published models -> the preset of that shape. GLM-5.1 is GLM-5's architecture with new
# weights; the organisation prefix ("zai-org/"), the case and an "-FP8" suffix (the same shape, quantised) are
# ignored by `preset_name`.
ALIASES: dict[str, str] = {
    "glm-5.1": "glm-5", "glm5": "glm-5", "glm5.1": "glm-5",
    "glm4.5": "glm-4.5", "glm4.5-air": "glm-4.5-air", "glm-4.5air": "glm-4.5-air", "glm4.6": "glm-4.6",
    "glm4.7": "glm-4.7", "glm4.7-flash": "glm-4.7-flash", "glm-4.7flash": "glm-4.7-flash",
}
ORGANISATIONS = ("zai-org/", "thudm/")


def preset_name(name: str) -> str | None:
    """The preset `name` means ('GLM-5.1', 'zai-org/GLM-4.7-FP8', 'glm5' ...), or None when none."""
    if not isinstance(name, str):
        return None
    if name in PRESETS:
        return name
    key = name.strip().lower()
    for org in ORGANISATIONS:
        key = key.removeprefix(org)
    key = key.removesuffix("-fp8")
    key = ALIASES.get(key, key)
    return key if key in PRESETS else None


TRANSFORMERS_DEFAULTS: dict[str, dict] = {
    "glm_moe_dsa": {},  # ModelConfig's defaults are GlmMoeDsaConfig's
    "glm4_moe": dict(  # Glm4MoeConfig
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072,
        moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
        routed_scaling_factor=1.0, first_k_dense_replace=1, bos_token_id=None, eos_token_id=None,
        num_nextn_predict_layers=1,
    ),
    "glm5_next": dict(  # Glm5NextTextConfig
        model_type="glm5_next", hidden_size=4096, num_hidden_layers=45, n_routed_experts=288, q_lora_rank=1536,
        qk_rope_head_dim=0, qk_nope_head_dim=256, max_position_embeddings=1048576, pad_token_id=154820,
        bos_token_id=None, eos_token_id=None, swiglu_limit=10.0,
    ),
    "glm4_moe_lite": dict(  # Glm4MoeLiteConfig
        model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
        num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20, n_routed_experts=64,
        routed_scaling_factor=1.8, q_lora_rank=768, num_experts_per_tok=4, first_k_dense_replace=1,
    ),
}
