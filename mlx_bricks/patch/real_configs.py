"""Real-size configurations of the hybrid families (issue 42: state-space, short-conv and
gated-delta mixers), for the FLOP coverage of ``python -m mlx_bricks.patch.coverage``: each
is a released checkpoint's
``config.json`` fields that mlx-lm's ``ModelArgs`` reads (vocabulary, layer pattern, widths,
heads, experts), built lazily at full size (the weights are never evaluated).

Sources: the checkpoints' published ``config.json`` (Hugging Face model pages); where mlx-lm's
own ``ModelArgs`` defaults are a released shape (falcon_h1: Falcon-H1-0.5B; plamo2: PLaMo 2
8B's), those; one assumed shape (Kimi K3, no public config) is named so.
"""
from __future__ import annotations

import importlib

_INF = float("inf")


def _nemotron3_nano() -> dict:
    return dict(model_type="nemotron_h", vocab_size=131072, hidden_size=2688,
                intermediate_size=1856, max_position_embeddings=262144,
                num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                attention_bias=False, mamba_num_heads=64, mamba_head_dim=64,
                mamba_proj_bias=False, ssm_state_size=128, conv_kernel=4, n_groups=8,
                mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                hybrid_override_pattern=list(
                    "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
                n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                moe_shared_expert_intermediate_size=3712, n_shared_experts=1, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                time_step_limit=(0.0, _INF))


def _granite4(hidden, heads, kv, mamba_heads, experts=None, top_k=None, inter=None,
              shared=None) -> dict:
    layers = ["mamba"] * 40
    for i in (5, 15, 25, 35):
        layers[i] = "attention"
    return dict(model_type="granitemoehybrid", vocab_size=100352, hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=40, max_position_embeddings=131072,
                num_attention_heads=heads, num_key_value_heads=kv, attention_bias=False,
                embedding_multiplier=12.0, attention_multiplier=0.0078125, logits_scaling=8.0,
                residual_multiplier=0.22, layer_types=layers, rms_norm_eps=1e-5,
                num_local_experts=experts, num_experts_per_tok=top_k,
                shared_intermediate_size=shared, mamba_n_heads=mamba_heads, mamba_d_head=64,
                mamba_proj_bias=False, mamba_d_state=128, mamba_d_conv=4, mamba_n_groups=1,
                mamba_conv_bias=True, position_embedding_type="nope")


def _lfm2_attention(layers: int, idxs) -> list:
    return ["full_attention" if i in idxs else "conv" for i in range(layers)]


# Multi-head latent attention families (docs/mla.md). Names say where the sizes come from
# where they are not a checkpoint's config.json: "mlx-lm defaults" (ModelArgs defaults that
# follow a released checkpoint) or "approximate" (the model card's totals: layers, heads,
# experts, cache size; the share moves little with them).
_DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                    topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                    max_position_embeddings=163840,
                    rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 4096})

#: name -> (mlx-lm model module, ModelArgs fields).
CONFIGS: dict[str, tuple[str, dict]] = {
    "Nemotron-3-Nano-30B-A3B": ("nemotron_h", _nemotron3_nano()),
    "Granite-4.0-H-Small": ("granitemoehybrid", _granite4(4096, 32, 8, 128, 72, 10, 768, 1536)),
    "Granite-4.0-H-Tiny": ("granitemoehybrid", _granite4(1536, 12, 4, 48, 64, 6, 512, 1024)),
    "Granite-4.0-H-Micro": ("granitemoehybrid", _granite4(2048, 32, 8, 64, inter=8192)),
    "Falcon-H1-0.5B": ("falcon_h1", dict(model_type="falcon_h1")),
    "Mamba-Codestral-7B": ("mamba2", dict(
        model_type="mamba2", num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096,
        intermediate_size=8192, state_size=128, num_hidden_layers=64,
        layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=8, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=False, time_step_limit=(0.0, _INF),
        time_step_rank=256)),
    "PLaMo-2-8B": ("plamo2", dict(model_type="plamo2")),
    "LFM2-1.2B": ("lfm2", dict(
        model_type="lfm2", vocab_size=65536, hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128000,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=2048, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, block_ff_dim=12288,
        layer_types=_lfm2_attention(16, (2, 5, 8, 10, 12, 14)))),
    "LFM2-8B-A1B": ("lfm2_moe", dict(
        model_type="lfm2_moe", vocab_size=65536, hidden_size=2048, intermediate_size=7168,
        moe_intermediate_size=1792, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=128000, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, use_expert_bias=True, num_dense_layers=2,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        layer_types=_lfm2_attention(24, (2, 6, 10, 14, 18, 21)))),
    "Jamba-v0.1": ("jamba", dict(
        model_type="jamba", vocab_size=65536, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        attn_layer_offset=4, attn_layer_period=8, expert_layer_offset=1,
        expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
        mamba_dt_rank=256, num_experts=16, num_experts_per_tok=2, rms_norm_eps=1e-6,
        max_position_embeddings=262144, tie_word_embeddings=False)),
    # Falcon-Mamba-7B (config.json): 64 Mamba-1 layers (mlx-lm's mamba.py, model_type
    # falcon_mamba: weightless B / C / time-step RMS norms), 8192 channels, N 16.
    "Falcon-Mamba-7B": ("mamba", dict(
        model_type="falcon_mamba", vocab_size=65024, hidden_size=4096, intermediate_size=8192,
        state_size=16, num_hidden_layers=64, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=256, tie_word_embeddings=False, use_bcdt_rms=True, mixer_rms_eps=1e-6)),
    # Gated-delta hybrids (issue 42). Kimi-Linear-48B-A3B (config.json as torchtitan's
    # KimiLinearModelArgs restates it): 27 layers, MLA on layers 4, 8, ..., 24, 27 (1-based),
    # Kimi Delta Attention (32 heads of 128) on the other 20; 256 experts of 1024, top 8, one
    # shared, layer 0 dense.
    "Kimi-Linear-48B-A3B": ("kimi_linear", dict(
        model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, intermediate_size=9216, head_dim=72,
        rope_theta=10000.0, rms_norm_eps=1e-5, model_max_length=1048576, num_experts=256,
        moe_intermediate_size=1024, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, num_experts_per_token=8,
        num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, 28)
                                           if i not in (4, 8, 12, 16, 20, 24, 27)]})),
    # Kimi K3: no public config here; mlx-lm's TextArgs defaults (hidden 7168, 93 layers, 96
    # heads, SiTU MLPs) with Kimi-Linear's 3:1 KDA : MLA layout (96 KDA heads of 128) and a
    # Kimi-K2-like MoE (384 experts of 2048, top 8, one shared) and MLA: assumed.
    "Kimi-K3-shaped (assumed)": ("kimi_k3", dict(model_type="kimi_k3", text_config=dict(
        model_type="kimi_k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
        num_attention_heads=96, num_key_value_heads=96, intermediate_size=33792,
        rms_norm_eps=1e-5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=384, moe_intermediate_size=2048,
        num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, 94) if i % 4]}))),
    # bailing_moe_v3: mlx-lm's ModelArgs defaults (24 layers, hidden 1536, KDA with 16 heads of
    # 128 on 3 of every 4 layers, MLA on the 4th, 128 experts of 512, top 8, one shared).
    "Bailing-MoE-V3 (mlx-lm)": ("bailing_moe_v3", dict(model_type="bailing_moe_v3")),
    # Olmo-Hybrid-7B (transformers' OlmoHybridConfig defaults): 32 layers, hidden 3840, Gated
    # DeltaNet (30 heads, key dim 96, value dim 192) on 3 of every 4 layers, full attention
    # (30 heads of 128) on the 4th, MLP 11008.
    "Olmo-Hybrid-7B": ("olmo_hybrid", dict(
        model_type="olmo_hybrid", vocab_size=100352, hidden_size=3840, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=30, num_key_value_heads=30, rms_norm_eps=1e-6,
        max_position_embeddings=65536, linear_num_key_heads=30, linear_num_value_heads=30,
        linear_key_head_dim=96, linear_value_head_dim=192, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True, tie_word_embeddings=False, attention_bias=False)),
    # Multi-head latent attention families (bricks/mla; _DEEPSEEK_V3 above).
    "DeepSeek-V3 / R1 (671B)": ("deepseek_v3", _DEEPSEEK_V3),
    "Kimi-K2 (1T)": ("deepseek_v3", dict(
        _DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
        n_routed_experts=384, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827)),
    "DeepSeek-V3.2 (671B)": ("deepseek_v32", dict(
        _DEEPSEEK_V3, model_type="deepseek_v32", index_head_dim=128, index_n_heads=64,
        index_topk=2048)),
    "GLM-5 (approximate)": ("deepseek_v32", dict(
        _DEEPSEEK_V3, model_type="deepseek_v32", vocab_size=154880, hidden_size=6144,
        intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
        num_key_value_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
        n_group=1, topk_group=1, index_n_heads=32, index_head_dim=128, index_topk=2048,
        rope_scaling=None)),
    "DeepSeek-V2.5 (236B)": ("deepseek_v2", dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=2, n_routed_experts=160,
        routed_scaling_factor=16.0, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, topk_method="group_limited_greedy", n_group=8,
        topk_group=3, num_experts_per_tok=6, first_k_dense_replace=1,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096})),
    "GLM-4.7-Flash (mlx-lm)": ("glm4_moe_lite", dict(model_type="glm4_moe_lite")),
    "Mistral-Small-4 (approximate)": ("mistral4", dict(
        model_type="mistral4", vocab_size=131072, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=2048, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=32, n_shared_experts=1, n_routed_experts=128,
        routed_scaling_factor=1.0, kv_lora_rank=256, q_lora_rank=1024, norm_topk_prob=True,
        max_position_embeddings=262144, rms_norm_eps=1e-6, topk_group=1, num_experts_per_tok=4,
        first_k_dense_replace=0, n_group=1, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=128,
        rope_parameters={"rope_type": "yarn", "factor": 64.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1})),
    "MiniCPM3-4B": ("minicpm3", dict(
        model_type="minicpm3", vocab_size=73448, hidden_size=2560, dim_model_base=256,
        num_hidden_layers=62, intermediate_size=6400, num_attention_heads=40,
        num_key_value_heads=40, rms_norm_eps=1e-5, q_lora_rank=768, qk_nope_head_dim=64,
        qk_rope_head_dim=32, kv_lora_rank=256, scale_depth=1.4, scale_emb=12,
        max_position_embeddings=32768,
        rope_scaling={"original_max_position_embeddings": 32768, "short_factor": [1.0] * 16,
                      "long_factor": [1.0] * 16})),
    "Youtu-LLM (mlx-lm)": ("youtu_llm", dict(model_type="youtu_llm")),
    "LongCat-Flash (approximate)": ("longcat_flash", dict(
        model_type="longcat_flash", vocab_size=131072, hidden_size=6144, num_layers=28,
        num_attention_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, ffn_hidden_size=12288,
        expert_ffn_hidden_size=2048, n_routed_experts=512, zero_expert_num=256, moe_topk=12,
        routed_scaling_factor=6.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=10000000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
        attention_method="MLA", zero_expert_type="identity", attention_bias=False)),
}


def build(name: str):
    """The mlx-lm model of real-size configuration ``name`` (:data:`CONFIGS`), its weights
    lazy (never evaluated: shapes only)."""
    module, fields = CONFIGS[name]
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    return mod.Model(mod.ModelArgs(**fields))
