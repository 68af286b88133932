"""Tiny random mlx-lm models for the patch tests, built from mlx-lm's own ``ModelArgs``.

Shapes are chosen so the bricks see what real models give them: head_dim 64, GQA (llama,
qwen3), q/k/v biases (qwen2), per-head q/k norms (qwen3), q width != hidden size (qwen3);
gemma3_text: head_dim 256, one KV head, a sliding-window layer (window 8) then a global one.
"""
from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

VOCAB = 256

# model_type -> ModelArgs fields (besides model_type and vocab_size).
CONFIGS = {
    "llama": dict(hidden_size=128, num_hidden_layers=3, intermediate_size=320,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=192,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True),
    # layer 0 sliding (window 8, RotatingKVCache), layer 1 global (sliding_window_pattern 2).
    "gemma3_text": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=160,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=8,
                        sliding_window_pattern=2, max_position_embeddings=4096),
    # soft-cap 5: tanh bends the (sharpened) scores of this tiny model noticeably
    "gemma2": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=160,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                   rms_norm_eps=1e-6, query_pre_attn_scalar=256, attn_logit_softcapping=5.0,
                   final_logit_softcapping=30.0),
    # layer 0 sliding (window 8, RotatingKVCache), layer 1 global (the default alternation);
    # attention sinks, q/k/v/o biases, GQA 2, head_dim 64, gpt-oss's YaRN RoPE; MoE MLPs of
    # 2 experts, both taken (top 2): no routing choice a rounding could flip.
    "gpt_oss": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                    num_local_experts=2, num_experts_per_tok=2, head_dim=64,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                    rope_theta=10000, rms_norm_eps=1e-5,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 4096}),
    # layers 0 and 2 Gated DeltaNet, 1 and 3 gated full attention (head_dim 64, partial RoPE
    # 25%, q/k norms, GQA 2); layer 1 a dense MLP (mlp_only_layers), 3 MoE with a gated shared
    # expert, 0 and 2 dense (decoder_sparse_step 2 puts MoE on odd layers).
    "qwen3_next": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       linear_num_value_heads=2, linear_num_key_heads=2,
                       linear_key_head_dim=32, linear_value_head_dim=32,
                       linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=2,
                       decoder_sparse_step=2, shared_expert_intermediate_size=96,
                       mlp_only_layers=[1], moe_intermediate_size=64, rms_norm_eps=1e-6,
                       rope_theta=10000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=4096, full_attention_interval=2,
                       tie_word_embeddings=False),
    # qwen3_5 (text_config): the same attention, every MLP dense (num_experts 0).
    "qwen3_5": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    full_attention_interval=2, rms_norm_eps=1e-6,
                    max_position_embeddings=4096, tie_word_embeddings=True,
                    rope_parameters={"type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25}),
    # layers 0, 2 sliding (head_dim 256, window 8), 1, 3 global (head_dim 512, values = keys,
    # partial proportional RoPE); layers 2 and 3 share layer 0's and 1's K/V
    # (num_kv_shared_layers, as E2B/E4B) and have double-wide MLPs; per-layer inputs.
    "gemma4_text": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                        global_head_dim=512, num_global_key_value_heads=1,
                        attention_k_eq_v=True, num_kv_shared_layers=2,
                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                        sliding_window=8, sliding_window_pattern=2, rms_norm_eps=1e-6,
                        max_position_embeddings=4096),
    # NoPE on every 2nd layer (no_rope_layers [1, 0]: mlx-lm swaps in an identity rope)
    "smollm3": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                    no_rope_layer_interval=2),
    # q/k/v biases (attention_bias), no o bias
    "seed_oss": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True),
    # YaRN rope, Llama-4 query scaling (a factor of 1 + 0.5 log(1 + floor(pos / 6)), so it
    # moves within a 20-token prompt), layer 0 sliding (window 8), layer 1 global
    "ministral3": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       rms_norm_eps=1e-5, max_position_embeddings=4096,
                       tie_word_embeddings=False, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 6,
                                        "beta_fast": 32.0, "beta_slow": 1.0,
                                        "rope_theta": 1000000.0,
                                        "llama_4_scaling_beta": 0.5}),
    # post-norm blocks, q/k RMSNorm over all heads' width
    "olmo2": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0),
    # olmo3: olmo2's blocks, layers 0-2 sliding (window 8), layer 3 global
    "olmo3": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=4096, sliding_window=8),
    # exaone4: post-norm blocks, per-head q/k norms, "LLLG": 3 sliding RoPE layers (window 8),
    # then a global NoPE layer
    "exaone4": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                    tie_word_embeddings=True, rope_scaling=None, sliding_window=8,
                    sliding_window_pattern="LLLG"),
    # glm4_moe: layer 0 dense, layer 1 MoE (4 routed experts, top 2, a shared expert);
    # partial RoPE (half of head_dim), q/k/v biases, per-head q/k norms
    "glm4_moe": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                     max_position_embeddings=4096, moe_intermediate_size=64,
                     norm_topk_prob=True, num_attention_heads=4, n_group=1, head_dim=64,
                     topk_group=1, n_shared_experts=1, n_routed_experts=4,
                     routed_scaling_factor=1.0, num_experts_per_tok=2,
                     first_k_dense_replace=1, num_key_value_heads=2, rms_norm_eps=1e-5,
                     rope_theta=10000.0, rope_scaling=None, use_qk_norm=True,
                     tie_word_embeddings=False, attention_bias=True,
                     partial_rotary_factor=0.5),
    # llama4_text: weightless per-head q/k RMSNorm before RoPE, layer 3 NoPE
    "llama4_text": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                        intermediate_size_mlp=256, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                        rope_theta=10000.0, tie_word_embeddings=False,
                        no_rope_layers=[1, 1, 1, 0], use_qk_norm=True),
    # llama-shaped families a table line covers
    "internlm3": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                      num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                      qkv_bias=True, rope_theta=10000.0),
    "helium": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                   num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                   attention_bias=False, head_dim=64, max_position_embeddings=4096,
                   mlp_bias=False, rope_theta=10000.0, tie_word_embeddings=False),
    # granite: residual_multiplier on each sublayer's output, attention_multiplier as the
    # attention scale (not head_dim ** -0.5)
    "granite": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                    num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                    logits_scaling=4.0, attention_multiplier=0.1, embedding_multiplier=2.0,
                    residual_multiplier=0.5, max_position_embeddings=4096,
                    attention_bias=False, mlp_bias=False, rope_theta=10000.0),
    # MoE families: olmoe (q/k norms over the full width), dots1 (qwen3's attention, layer 1
    # MoE with a shared expert), exaone_moe (exaone4's attention, pre-norm blocks, layers 0-2
    # sliding with RoPE, layer 3 global without; MoE on layers 1 and 3 with a shared expert)
    "olmoe": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                  num_experts=4, num_experts_per_tok=2),
    "dots1": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, first_k_dense_replace=1,
                  moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                  norm_topk_prob=True, num_experts_per_tok=2, rope_theta=10000.0,
                  routed_scaling_factor=1.0),
    "exaone_moe": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                       moe_intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                       rms_norm_eps=1e-6, max_position_embeddings=4096, sliding_window=8,
                       layer_types=["sliding_attention"] * 3 + ["full_attention"],
                       is_moe_layer=[False, True, False, True], routed_scaling_factor=1.0),
    # the layer stack runs twice (num_loops 2, shared weights, a cache per loop)
    "nanbeige": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                     head_dim=64, num_loops=2),
    # qwen3's attention, MoE layers, layer 0 sliding (window 8)
    "mellum": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                   num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=64, rms_norm_eps=1e-6, num_key_value_heads=2,
                   head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
                   norm_topk_prob=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 500000.0}}),
    # gated-delta hybrids: layers 0-2 a gated-delta mixer (2 heads of 32; olmo_hybrid 2/4 heads
    # of 32/16), layer 3 attention (MLA for kimi_linear, kimi_k3, bailing_moe_v3; olmo_hybrid
    # a post-norm full attention); MoE on layers 1-3 (4 experts, top 2, a shared expert)
    "kimi_linear": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                        rope_theta=10000.0, rms_norm_eps=1e-6, model_max_length=4096,
                        linear_attn_config={"num_heads": 2, "head_dim": 32,
                                            "short_conv_kernel_size": 4,
                                            "kda_layers": [1, 2, 3]},
                        num_experts=4, moe_intermediate_size=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_experts_per_token=2, num_shared_experts=1,
                        first_k_dense_replace=1),
    "kimi_k3": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96,
                    num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6,
                    linear_attn_config={"num_heads": 2, "head_dim": 32,
                                        "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3]},
                    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, num_experts=4, moe_intermediate_size=32,
                    num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1),
    "bailing_moe_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
                           num_shared_experts=1, first_k_dense_replace=1, n_group=2,
                           topk_group=1, routed_scaling_factor=1.0, head_dim=32,
                           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0,
                           max_position_embeddings=4096),
    "olmo_hybrid": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        rms_norm_eps=1e-6, max_position_embeddings=4096,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=32, linear_value_head_dim=16,
                        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                        tie_word_embeddings=False, attention_bias=False),
}

# Multi-head latent attention (bricks/mla): kv_lora_rank 256 > (nope + v) / 2, so a prompt from
# an empty cache decompresses (the bricks) and a short second turn absorbs (op.choose_form);
# DeepSeek-V3's sizes (rank 512, head widths 192 / 128) on deepseek_v3, 96 / 64 elsewhere;
# deepseek_v32's indexer keeps 64 keys (longer calls select: stock); layer 0 dense, layer 1
# MoE (4 experts, top 2, a shared expert) where the family has MoE.
_MLA = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=192, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=256, q_lora_rank=96, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=4096)
_MLA_MOE = dict(moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
         "beta_slow": 1, "original_max_position_embeddings": 64}
CONFIGS.update({
    "deepseek_v3": dict(_MLA, **_MLA_MOE, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, rope_scaling=_YARN),
    "deepseek_v32": dict(_MLA, **_MLA_MOE, index_head_dim=32, index_n_heads=2, index_topk=64,
                         rope_scaling=_YARN),
    "deepseek_v2": dict(_MLA, **_MLA_MOE, rope_scaling=_YARN, topk_method="greedy"),
    "glm4_moe_lite": dict(_MLA, **_MLA_MOE),
    "mistral4": dict(_MLA, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0,
                     norm_topk_prob=True, topk_group=1, n_group=1,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                      "original_max_position_embeddings": 6,
                                      "beta_fast": 32.0, "beta_slow": 1.0,
                                      "llama_4_scaling_beta": 0.5}),
    "minicpm3": dict({k: v for k, v in _MLA.items() if k != "v_head_dim"}, hidden_size=256,
                     dim_model_base=256, scale_depth=1.4, scale_emb=12,
                     rope_scaling={"original_max_position_embeddings": 4096,
                                   "short_factor": [1.0] * 16, "long_factor": [1.0] * 16}),
    "youtu_llm": dict(_MLA),
    "bailing_hybrid": dict(_MLA, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                           moe_intermediate_size=64, n_group=1, topk_group=1,
                           first_k_dense_replace=1, layer_group_size=1, group_norm_size=1,
                           routed_scaling_factor=1.0, head_dim=64),
    # two MLA modules and two dense MLPs per layer around a MoE with 2 identity experts
    "longcat_flash": dict(hidden_size=128, ffn_hidden_size=192, moe_topk=2,
                          expert_ffn_hidden_size=64, n_routed_experts=4, zero_expert_num=2,
                          num_layers=2, max_position_embeddings=4096, num_attention_heads=4,
                          kv_lora_rank=256, q_lora_rank=96, qk_rope_head_dim=32,
                          qk_nope_head_dim=64, v_head_dim=64, routed_scaling_factor=1.0,
                          rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True,
                          mla_scale_kv_lora=True, attention_method="MLA",
                          zero_expert_type="identity", attention_bias=False),
})
CONFIGS["longcat_flash_ngram"] = dict(CONFIGS["longcat_flash"], ngram_vocab_size_ratio=2,
                                      emb_neighbor_num=2, emb_split_num=2)
del CONFIGS["longcat_flash_ngram"]["attention_method"]
# kimi_linear, kimi_k3, bailing_moe_v3 keep the gated-delta tests' configs above (layers 0-2
# Kimi Delta Attention, layer 3 MLA); the MLA tests give their MLA layer supported widths:
MLA_OVERRIDES = {t: dict(kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                         v_head_dim=64) for t in ("kimi_linear", "bailing_moe_v3")}
MLA_OVERRIDES["kimi_k3"] = dict(MLA_OVERRIDES["kimi_linear"], q_lora_rank=96,
                                mla_use_output_gate=True)
MLA_TYPES = ("deepseek_v3", "deepseek_v32", "deepseek_v2", "glm4_moe_lite", "mistral4",
             "minicpm3", "youtu_llm", "kimi_linear", "bailing_hybrid", "bailing_moe_v3",
             "longcat_flash", "longcat_flash_ngram", "kimi_k3")

# Multimodal wrappers: the text model's args under text_config (vocab included).
# llama4: 4 layers, chunked attention (chunks of 8) on layers 0-2, layer 3 NoPE and global with
# the attention temperature (floor_scale 4 so it moves within a prompt); MoE (4 experts, top 1,
# a shared expert) on layers 1 and 3, dense MLPs on 0 and 2.
CONFIGS["llama4"] = dict(text_config=dict(
    model_type="llama4_text", vocab_size=VOCAB, attention_bias=False, attention_chunk_size=16,
    head_dim=64, hidden_size=128, interleave_moe_layer_step=2, intermediate_size=64,
    intermediate_size_mlp=256, max_position_embeddings=4096, num_attention_heads=4,
    num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2, num_local_experts=4,
    rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0, use_qk_norm=True,
    floor_scale=4, attn_scale=0.5))
CONFIGS["mistral3"] = dict(text_config=dict(CONFIGS["llama"], model_type="llama",
                                             vocab_size=VOCAB))

# Parameters scaled up to sharpen attention (q_norm/k_norm: qwen3 normalises q and k per head).
ATTENTION_SHARPEN = ("q_proj.", "k_proj.", "q_norm.", "k_norm.")
# ... and, in the MLA families' own tiny configs, the MLA query and key decompression.
MLA_SHARPEN = ("q_b_proj.", "embed_q.")

# model_type -> mlx-lm module that builds it (mlx_lm.utils.MODEL_REMAPPING: mistral -> llama).
MODULES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma3_text": "gemma3_text", "gemma2": "gemma2", "gpt_oss": "gpt_oss",
           "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "gemma4_text": "gemma4_text",
           "smollm3": "smollm3",
           "seed_oss": "seed_oss", "ministral3": "ministral3", "olmo2": "olmo2",
           "olmo3": "olmo3", "exaone4": "exaone4", "glm4_moe": "glm4_moe",
           "llama4_text": "llama4_text", "mistral3": "mistral3", "llama4": "llama4",
           "internlm3": "internlm3", "helium": "helium", "nanbeige": "nanbeige",
           "mellum": "mellum", "granite": "granite", "olmoe": "olmoe", "dots1": "dots1",
           "exaone_moe": "exaone_moe", "kimi_linear": "kimi_linear", "kimi_k3": "kimi_k3",
           "bailing_moe_v3": "bailing_moe_v3", "olmo_hybrid": "olmo_hybrid",
           **{t: t for t in MLA_TYPES}}

# Architectures whose q/k are RMS-normalised with scale 1.0 (gemma4): their scores are already
# peaked (std ~ sqrt(head_dim)); q/k are not sharpened further.
NO_SHARPEN = ("gemma4_text",)

# Model types whose ModelArgs wrap the text model's fields in ``text_config``.
TEXT_CONFIG = ("qwen3_5", "kimi_k3")

# Architectures whose RMSNorm computes rms_norm(x, 1 + w): their stored norm weights are the
# effective ones minus 1.
OFFSET_NORMS = ("gemma3_text", "gemma2")


def model_args(model_type: str, **overrides):
    """mlx-lm ``ModelArgs`` of a tiny ``model_type`` model with ``overrides`` applied."""
    module = importlib.import_module(f"mlx_lm.models.{MODULES[model_type]}")
    fields = dict(CONFIGS[MODULES[model_type]], model_type=model_type, vocab_size=VOCAB)
    fields.update(overrides)
    if MODULES[model_type] in TEXT_CONFIG:
        return module, module.ModelArgs(model_type=model_type, text_config=fields)
    if "text_config" in fields:  # a wrapper: the vocabulary is the text model's
        del fields["vocab_size"]
        fields["text_config"] = dict(fields["text_config"])
    return module, module.ModelArgs(**fields)


def build_model(model_type: str, dtype=mx.float32, *, seed: int = 0, **overrides) -> nn.Module:
    """A random tiny mlx-lm model of ``model_type`` in ``dtype`` (weights rounded to it).

    Norm weights are drawn around 1 (not left at 1) so a fused kernel that drops or misplaces
    a norm weight changes the result. The final norm is scaled by 4 so the next-token logits
    have gaps well above float16/bfloat16 rounding: greedy tokens then test the bricks, not
    ties between near-equal logits. Queries and keys are scaled by 3 (scores by 9) so attention
    is peaked as in trained models; with near-uniform attention a wrong position or mask would
    hardly change the output. For gemma (``OFFSET_NORMS``) these are the effective norm weights
    ``1 + w``: the stored ``w`` is drawn 1 lower, so the model is as well conditioned as the
    others.
    """
    module, args = model_args(model_type, **overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed + 1), len(params))
    new = []
    for k, (name, p) in zip(keys, params):
        if name.endswith("norm.weight"):
            scale = 4.0 if name == "model.norm.weight" else 1.0
            p = scale * (1.0 + 0.2 * mx.random.normal(p.shape, key=k))
        sharpen = ATTENTION_SHARPEN + (MLA_SHARPEN if model_type in MLA_TYPES
                                       and model_type not in MLA_OVERRIDES else ())
        if any(t in name for t in sharpen) and MODULES[model_type] not in NO_SHARPEN:
            p = 3.0 * p
        if name.endswith(".sinks"):  # gpt-oss: sinks of the scores' size (init: zeros)
            p = 4.0 * mx.random.normal(p.shape, key=k)
        if name.endswith("norm.weight") and MODULES[model_type] in OFFSET_NORMS:
            p = p - 1.0
        new.append((name, p))
    model.update(tree_unflatten(new))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def clone(model: nn.Module, dtype) -> nn.Module:
    """A stock copy of ``model`` (same model file and args) with its weights cast to ``dtype``.

    Cast from the rounded weights of ``model``, so a float64 clone is the exact-arithmetic
    reference of the same network.
    """
    module = importlib.import_module(type(model).__module__)
    args = model.args
    if dataclasses.is_dataclass(getattr(args, "text_config", None)):  # built from a dict again
        args = dataclasses.replace(args, text_config=dataclasses.asdict(args.text_config))
    copy = module.Model(args)
    copy.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    mx.eval(copy.parameters())
    return copy


def tokens(n: int, batch: int = 1, seed: int = 0) -> mx.array:
    """(batch, n) random token ids."""
    return mx.random.randint(0, VOCAB, (batch, n), key=mx.random.key(1000 + seed)).astype(
        mx.int32)
