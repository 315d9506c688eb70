"""Model presets, as data. `ModelConfig.from_preset(name, **overrides)` builds a config from one.

- tiny:  unit tests (a forward takes milliseconds).
- small: the CPU demo scale (~14M parameters; trains in minutes on 2 cores).
- glm-5: the published GLM-5 shape (transformers' GlmMoeDsaConfig defaults): ~744B total, ~40B active.
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
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # transformers 5.23.0 GlmMoeDsaConfig defaults (zai-org/GLM-5).
    "glm-5": dict(),
}
