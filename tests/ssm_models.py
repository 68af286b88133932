"""Tiny random mlx-lm models of the state-space and short-conv families (issue 42), built from
mlx-lm's own classes: Mamba-2 mixers (mamba2, nemotron_h, granitemoehybrid, falcon_h1, plamo2)
and LFM2's short convolutions (lfm2, lfm2_moe), with their attention, MLP and MoE layers.

Shapes: attention head_dim 64 (an attention brick size), Mamba-2 heads of 16 in 2 groups
(plamo2: one), N = 16, 3 or 4 conv taps; every family's hybrid layout has a mixer, an
attention layer and an MLP or MoE layer.
"""
from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

VOCAB = 256
INF = float("inf")

_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
              mamba_proj_bias=False, mamba_conv_bias=True)

CONFIGS = {
    "mamba2": dict(num_heads=4, head_dim=16, hidden_size=64, intermediate_size=128,
                   state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4,
                   n_groups=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                   time_step_limit=(0.0, INF), time_step_rank="auto"),
    # Mamba-2, dense relu2 MLP, attention (no RoPE), MoE (relu2 SwitchMLP, shared expert)
    "nemotron_h": dict(hidden_size=128, intermediate_size=128, max_position_embeddings=4096,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
                       mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                       use_conv_bias=True, hybrid_override_pattern=list("M-M*ME"),
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1,
                       topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                       time_step_limit=(0.0, INF)),
    # Granite 4.0-H: Mamba-2 and NoPE attention layers, each with MoE experts and a shared MLP
    "granitemoehybrid": dict(hidden_size=128, intermediate_size=32, num_hidden_layers=4,
                             max_position_embeddings=4096, num_attention_heads=2,
                             num_key_value_heads=1, attention_bias=False,
                             embedding_multiplier=2.0, attention_multiplier=0.125,
                             logits_scaling=2.0, residual_multiplier=0.5,
                             layer_types=["mamba", "attention", "mamba", "mamba"],
                             rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=32, mamba_n_groups=2,
                             position_embedding_type="nope", **_MAMBA),
    # parallel Mamba-2 and attention in every layer, then a SwiGLU MLP
    "falcon_h1": dict(hidden_size=128, head_dim=64, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=128, mamba_d_ssm=64,
                      mamba_d_head=16, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2,
                      num_hidden_layers=2, vocab_size=VOCAB, rope_theta=10000.0),
    # layer 0 Mamba (B, C, dt projected from the conv output), layer 1 attention
    "plamo2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, hidden_size_per_head=32, mamba_d_state=16,
                   mamba_d_conv=4, mamba_num_heads=4, intermediate_size=128),
    # short convs (3 taps, both gates) and an attention layer, SwiGLU MLPs (w1, w3, w2)
    "lfm2": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=1,
                 num_key_value_heads=1, max_position_embeddings=4096, norm_eps=1e-5,
                 conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True, block_ff_dim=192,
                 layer_types=["conv", "full_attention", "conv"]),
    "lfm2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=1, num_key_value_heads=1,
                     max_position_embeddings=4096, num_experts=4, num_experts_per_tok=2,
                     norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1,
                     norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                     layer_types=["conv", "full_attention", "conv"]),
    # Mamba-1 layers (the selective-scan brick), a NoPE attention layer, MLP and MoE
    # feed-forwards
    "jamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=1, num_key_value_heads=1, attn_layer_offset=1,
                  attn_layer_period=4, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, num_experts=4,
                  num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
                  tie_word_embeddings=False),
    # Mamba-1 layers only, Falcon-Mamba's weightless B / C / time-step RMS norms
    "mamba": dict(hidden_size=64, intermediate_size=128, state_size=8, num_hidden_layers=2,
                  conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8,
                  use_bcdt_rms=True),
}


#: Overrides that make the MoE families dense: MLX 0.32.4's CPU ``gather_mm`` (float experts)
#: computes float32 only, so their half-precision models run stock on the CPU only this way.
DENSE = {"nemotron_h": dict(hybrid_override_pattern=list("M-M*M-")),
         "jamba": dict(num_experts=1), "granitemoehybrid": dict(num_local_experts=None), "lfm2_moe": dict(num_dense_layers=3)}


def model_args(model_type: str, **overrides):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = dict(CONFIGS[model_type], model_type=model_type, vocab_size=VOCAB)
    fields.update(overrides)
    return module, module.ModelArgs(**fields)


def build(model_type: str, dtype=mx.float32, *, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random ``model_type`` model in ``dtype``: mlx-lm's initialisation with its 2-D
    weights doubled (so the mixers matter), the time-step biases drawn so that the steps spread
    over 0.01-1 (Mamba-2's range and beyond: decays from near 1 to near 0), norm weights
    around 1."""
    module, args = model_args(model_type, **overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    model.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters()))
    keys = iter(mx.random.split(mx.random.key(seed + 1), 64))
    for _, m in model.named_modules():
        if isinstance(m.get("dt_bias"), mx.array):
            H = m.dt_bias.shape[0]
            step = mx.exp(mx.random.uniform(-4.6, 0.0, (H,), key=next(keys)))
            m.dt_bias = mx.log(mx.expm1(step))
            m.D = mx.random.normal((H,), key=next(keys))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tokens(n: int, batch: int = 1, seed: int = 0) -> mx.array:
    return mx.random.randint(0, VOCAB, (batch, n), key=mx.random.key(1000 + seed)).astype(
        mx.int32)


def kind_args(dtype) -> dict:
    """Model-like arguments of the ``ssd``, ``selective_scan`` and ``short_conv`` kinds (their
    own synthetic values) for the generic kind tests (tests/test_tune.py)."""
    from mlx_bricks.bricks.selective_scan.kind import SELECTIVE_SCAN_KIND
    from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
    from mlx_bricks.bricks.ssd.kind import SSD_KIND
    from mlx_bricks.runtime.kind import Act

    act = Act((2, 9, 64), dtype)
    ssd = SSD_KIND.synthetic({
        "x": Act((2, 9, 4, 16), dtype), "dt": Act((2, 9, 4), dtype),
        "A_log": Act((4,), mx.float32), "B": Act((2, 9, 2, 16), dtype),
        "C": Act((2, 9, 2, 16), dtype), "D": Act((4,), dtype), "dt_bias": Act((4,), dtype),
        "state": Act((2, 4, 16, 16), mx.float32)}, seed=3)
    conv = SHORT_CONV.synthetic({
        "x": act, "gate_in": act, "gate_out": act, "state": Act((2, 2, 64), dtype),
        "weight": mx.random.normal((64, 3, 1), key=mx.random.key(3)).astype(dtype)}, seed=3)
    scan = SELECTIVE_SCAN_KIND.synthetic({
        "x": act, "dt": act, "A_log": Act((64, 8), mx.float32), "B": Act((2, 9, 8), dtype),
        "C": Act((2, 9, 8), dtype), "D": Act((64,), dtype), "state": Act((2, 64, 8), dtype)},
        seed=3)
    return {"ssd": ssd, "short_conv": conv, "selective_scan": scan}
