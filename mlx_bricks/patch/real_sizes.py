"""Real-size shapes of model families, for the FLOP coverage of ``python -m
mlx_bricks.patch.coverage`` (their weights are never evaluated: mlx-lm builds them lazily).

Each entry: ``model_type -> (name, source, config)``, the config as mlx-lm's ``ModelArgs`` (or
``text_config``) fields, with the source of the figures. Add a family by one entry.
"""
from __future__ import annotations

import importlib

# Kimi-Linear-48B-A3B (moonshotai/Kimi-Linear-48B-A3B-Instruct, config.json as torchtitan's
# KimiLinearModelArgs restates it): 27 layers, MLA on layers 4, 8, ..., 24, 27 (1-based),
# Kimi Delta Attention (32 heads of 128) on the other 20; 256 experts of 1024, top 8, one
# shared expert, layer 0 dense.
_KIMI_LINEAR = dict(
    vocab_size=163840, hidden_size=2304, num_hidden_layers=27, num_attention_heads=32,
    num_key_value_heads=32, intermediate_size=9216, head_dim=72, rope_theta=10000.0,
    rms_norm_eps=1e-5, model_max_length=1048576, num_experts=256, moe_intermediate_size=1024,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    mla_use_nope=True, num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
    linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                        "kda_layers": [i for i in range(1, 28)
                                       if i not in (4, 8, 12, 16, 20, 24, 27)]})

REAL_SIZES: dict[str, tuple[str, str, dict]] = {
    "kimi_linear": ("Kimi-Linear-48B-A3B", "Kimi-Linear-48B-A3B-Instruct config", _KIMI_LINEAR),
    # Kimi K3 has no public config here: mlx-lm 0.32.2's TextArgs defaults (hidden 7168, 93
    # layers, 96 heads, SiTU MLPs) with Kimi-Linear's 3:1 KDA : MLA layout (96 KDA heads of
    # 128) and a Kimi-K2-like MoE (384 experts of 2048, top 8, one shared) and MLA: assumed.
    "kimi_k3": ("Kimi-K3-shaped (assumed)", "mlx-lm TextArgs defaults + assumptions", dict(
        model_type="kimi_k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
        num_attention_heads=96, num_key_value_heads=96, intermediate_size=33792,
        rms_norm_eps=1e-5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=384, moe_intermediate_size=2048,
        num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, 94) if i % 4]})),
    # bailing_moe_v3: mlx-lm 0.32.2's ModelArgs defaults (24 layers, hidden 1536, KDA on 3 of
    # every 4 layers with 16 heads of 128, MLA on the 4th, 128 experts of 512, top 8, one
    # shared, layer 0 dense).
    "bailing_moe_v3": ("Bailing-MoE-V3-shaped", "mlx-lm ModelArgs defaults", {}),
    # Olmo-Hybrid-7B (allenai/Olmo-Hybrid-7B; transformers' OlmoHybridConfig defaults): 32
    # layers, hidden 3840, Gated DeltaNet (30 heads, key dim 96, value dim 192) on 3 of every
    # 4 layers, full attention (30 heads of 128) on the 4th, MLP 11008.
    "olmo_hybrid": ("Olmo-Hybrid-7B", "OlmoHybridConfig defaults", dict(
        vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=30, num_key_value_heads=30, rms_norm_eps=1e-6,
        max_position_embeddings=65536, linear_num_key_heads=30, linear_num_value_heads=30,
        linear_key_head_dim=96, linear_value_head_dim=192, linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True, tie_word_embeddings=False, attention_bias=False)),
}

#: Model types whose ``ModelArgs`` wrap the text model's fields in ``text_config``.
_TEXT_CONFIG = ("kimi_k3",)


def build(model_type: str):
    """mlx-lm's model of ``model_type`` at its real size (:data:`REAL_SIZES`), not evaluated.

    Raises:
        KeyError: ``model_type`` has no entry.
    """
    _, _, config = REAL_SIZES[model_type]
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = {"model_type": model_type, **config}
    if model_type in _TEXT_CONFIG:
        args = module.ModelArgs(model_type=model_type, text_config=fields)
    else:
        args = module.ModelArgs(**fields)
    return module.Model(args)
