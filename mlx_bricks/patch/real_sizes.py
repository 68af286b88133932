"""Real-size configurations of the families ``python -m mlx_bricks.patch.coverage`` reports:
model label -> (model_type, mlx-lm config fields). Built lazily (MLX arrays are not evaluated),
so a 671B model costs no memory; only shapes matter to the count.

``source`` says where the sizes come from: ``config.json`` (the published checkpoint's, as
transcribed here), ``mlx-lm defaults`` (the ``ModelArgs`` defaults of mlx-lm 0.32.2, which
follow a published checkpoint), or ``approximate`` (from the model card's totals: head counts,
experts, layers and cache size; the share moves little with them, the parts' ratios decide it).
"""
from __future__ import annotations

_DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                    topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                    max_position_embeddings=163840,
                    rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 4096})

#: label -> (model_type, config fields, source)
REAL_SIZES: dict[str, tuple[str, dict, str]] = {
    "DeepSeek-V3 / R1 (671B)": ("deepseek_v3", _DEEPSEEK_V3, "config.json"),
    "Kimi-K2 (1T)": ("deepseek_v3", dict(_DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64,
                                          num_key_value_heads=64, n_routed_experts=384,
                                          first_k_dense_replace=1, n_group=1, topk_group=1,
                                          routed_scaling_factor=2.827), "config.json"),
    "DeepSeek-V3.2 (671B)": ("deepseek_v32", dict(_DEEPSEEK_V3, index_head_dim=128,
                                                  index_n_heads=64, index_topk=2048),
                             "config.json"),
    "GLM-5 (glm_moe_dsa)": ("deepseek_v32", dict(
        _DEEPSEEK_V3, vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048,
        qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1, index_n_heads=32,
        index_head_dim=128, index_topk=2048, rope_scaling=None), "approximate"),
    "DeepSeek-V2.5 (236B)": ("deepseek_v2", dict(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=2, n_routed_experts=160, routed_scaling_factor=16.0, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="group_limited_greedy", n_group=8, topk_group=3, num_experts_per_tok=6,
        first_k_dense_replace=1,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}),
        "config.json"),
    "GLM-4.7-Flash (glm4_moe_lite)": ("glm4_moe_lite", {}, "mlx-lm defaults"),
    "Mistral Small 4 (119B)": ("mistral4", dict(
        vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=32,
        n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, kv_lora_rank=256,
        q_lora_rank=1024, norm_topk_prob=True, max_position_embeddings=262144,
        rms_norm_eps=1e-6, topk_group=1, num_experts_per_tok=4, first_k_dense_replace=0,
        n_group=1, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128,
        rope_parameters={"rope_type": "yarn", "factor": 64.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1}), "approximate"),
    "MiniCPM3-4B": ("minicpm3", dict(
        vocab_size=73448, hidden_size=2560, dim_model_base=256, num_hidden_layers=62,
        intermediate_size=6400, num_attention_heads=40, num_key_value_heads=40,
        rms_norm_eps=1e-5, q_lora_rank=768, qk_nope_head_dim=64, qk_rope_head_dim=32,
        kv_lora_rank=256, scale_depth=1.4, scale_emb=12, max_position_embeddings=32768,
        rope_scaling={"original_max_position_embeddings": 32768, "short_factor": [1.0] * 16,
                      "long_factor": [1.0] * 16}), "config.json"),
    "Youtu-LLM": ("youtu_llm", {}, "mlx-lm defaults"),
    "Kimi-Linear-48B-A3B": ("kimi_linear", dict(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=9216, head_dim=72, rope_theta=10000.0,
        rms_norm_eps=1e-5, model_max_length=1048576, num_experts=256,
        moe_intermediate_size=1024, num_experts_per_token=8, num_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, routed_scaling_factor=2.446,
        linear_attn_config={"kda_layers": [i for i in range(1, 28) if i % 4],
                            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}),
        "approximate"),
    "Ling (bailing_moe_v3)": ("bailing_moe_v3", {}, "mlx-lm defaults"),
    "LongCat-Flash (560B)": ("longcat_flash", dict(
        vocab_size=131072, hidden_size=6144, num_layers=28, num_attention_heads=64,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, ffn_hidden_size=12288, expert_ffn_hidden_size=2048,
        n_routed_experts=512, zero_expert_num=256, moe_topk=12, routed_scaling_factor=6.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0,
        mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_method="MLA",
        zero_expert_type="identity", attention_bias=False), "approximate"),
}
