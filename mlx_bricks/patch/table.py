"""What each supported mlx-lm architecture's decoder block looks like.

One entry per ``model_type`` (mlx-lm's ``config.json`` field); the patch routine is the same for
all of them. Entries are data (``nn.layout.BlockLayout``), each with the mlx-lm forwards it was
read against (``vetted``: a module whose ``__call__`` is not one of them stays stock,
``patch.vetted``). Biases are found on the modules themselves (qwen2 has q/k/v biases, llama has
them with ``attention_bias``/``mlp_bias``), so they need no entry here. Neither do MoE experts
(every mlx-lm ``SwitchGLU``) nor the token mixers of ``patch.modules.MIXERS`` (Gated DeltaNet,
...): they are patched by module class whatever the model_type (``patch.modules``); a
model_type not listed here keeps its other token mixers and dense MLPs stock.
"""
from __future__ import annotations

import dataclasses
import numbers

from mlx_bricks.nn.layout import BlockLayout

# gemma's blocks wrap each sublayer in two norms (input / post-attention, pre- / post-
# feedforward; gemma3 also clips the fp16 residual): not the unified pre-norm block.
_SANDWICH = ("the block normalises each sublayer's output too (post_attention_layernorm, "
             "post_feedforward_layernorm): the unified block is pre-norm only; attention and "
             "MLP are patched one by one")


def _calls(module: str, **digests: str) -> tuple[str, ...]:
    """``vetted`` fingerprints (``mlx_bricks.patch.vetted``) of classes of one mlx-lm model file:
    ``Class=sha256[:12]`` of ``Class.__call__``'s source."""
    return tuple(f"mlx_lm.models.{module}.{cls}.__call__={d}" for cls, d in digests.items())


# qwen3_next's gated attention and its MLP (also the MoE block's shared expert); qwen3_5 and
# qwen3_5_moe build their full-attention layers and MLPs from these classes too.
_QWEN3_NEXT = _calls("qwen3_next", Qwen3NextAttention="ffa6d648326b",
                     Qwen3NextMLP="07c9ab86cb8f")


# DeepSeek-V3's dense SwiGLU MLP (also its MoE layers' shared experts; mistral4 builds its MLPs
# from this class).
_DEEPSEEK_V3_MLP = _calls("deepseek_v3", DeepseekV3MLP="d28884f84783")

# The mlx-lm 0.32.2 forwards each entry was read against (a different forward stays stock).
_LLAMA = _calls("llama", Attention="dc1cc3af5b0a", MLP="07c9ab86cb8f",
                TransformerBlock="61ea9549fdd9")

# post-norm blocks: each sublayer's output is normalised before the residual add, the input
# is not (olmo2, olmo3, exaone4).
_POST_NORM = ("post-norm block (the sublayers' outputs are normalised: post_attention_layernorm, "
              "post_feedforward_layernorm; no input norm): the unified block is pre-norm; "
              "attention and MLP are patched one by one")

# hybrids whose layers branch between mixer kinds (attention, Mamba, short conv) or scale or
# parallel their sublayers (issue 42).
_HYBRID = ("hybrid layers (the token mixer is attention on some layers, a Mamba-2 / short-conv "
           "/ Mamba-1 mixer on others, or runs beside one; sublayers may be scaled): attention "
           "and MLP are patched one by one, the mixers by module")
# hybrid blocks whose attention slot holds a token mixer (Kimi Delta Attention) or an MLA
# module: no unified block.
_KDA_HYBRID = ("the attention slot holds a Kimi Delta Attention mixer (patched by module) or "
               "an MLA attention (no brick reads it): the MLP is patched alone")

ARCHITECTURES: dict[str, BlockLayout] = {
    # llama: layers with use_sliding (layer_types "sliding_attention") get a RotatingKVCache
    # of sliding_window and mlx-lm's window mask; the bricks run them with that window.
    "llama": BlockLayout(source="mlx_lm/models/llama.py", layer_sliding="use_sliding",
                         window_arg="sliding_window", vetted=_LLAMA),
    "qwen2": BlockLayout(source="mlx_lm/models/qwen2.py", vetted=_calls(
        "qwen2", Attention="b97fca5ccb66", MLP="07c9ab86cb8f", TransformerBlock="61ea9549fdd9")),
    # qwen3: per-head RMSNorm of q and k (over head_dim) before RoPE.
    "qwen3": BlockLayout(source="mlx_lm/models/qwen3.py", qk_norm=("q_norm", "k_norm"),
                         vetted=_calls("qwen3", Attention="0e5c13cbedb7", MLP="07c9ab86cb8f",
                                       TransformerBlock="61ea9549fdd9")),
    # qwen3_moe / qwen2_moe: qwen3's / qwen2's attention; a MoE layer's mlp is a sparse block
    # (router, SwitchGLU experts, qwen2_moe's shared expert): those layers are not fused, their
    # experts are patched by module.
    "qwen3_moe": BlockLayout(source="mlx_lm/models/qwen3_moe.py", qk_norm=("q_norm", "k_norm"),
                             vetted=_calls("qwen3_moe", Attention="8be888322dfa",
                                           MLP="07c9ab86cb8f",
                                           Qwen3MoeDecoderLayer="61ea9549fdd9")),
    "qwen2_moe": BlockLayout(source="mlx_lm/models/qwen2_moe.py", vetted=_calls(
        "qwen2_moe", Attention="b97fca5ccb66", MLP="07c9ab86cb8f",
        Qwen2MoeDecoderLayer="61ea9549fdd9")),
    # gemma3 (text): RMSNorm of 1 + w (q/k norms too), GELU-tanh MLP, scale from
    # query_pre_attn_scalar (the module's own scale), sliding-window layers (is_sliding, a
    # RotatingKVCache of sliding_window) between global ones; embedding scaling stays in the
    # model's own code (outside the layers).
    "gemma3_text": BlockLayout(source="mlx_lm/models/gemma3_text.py",
                               qk_norm=("q_norm", "k_norm"), offset_norm=True,
                               activation="gelu_tanh",
                               sliding="is_sliding", window_arg="sliding_window",
                               unfused=_SANDWICH, vetted=_calls(
                                   "gemma3_text", Attention="6c646cd7e827",
                                   MLP="fcd7015edea2", TransformerBlock="164ea44802f7")),
    # gemma2: 1 + w RMSNorms, GELU-tanh MLP, attention logit soft-capping
    # (attn_logit_softcapping), the causal mask passed as an array (return_array=True). mlx-lm's
    # gemma2 has no sliding-window layers (every layer attends globally), so neither do we.
    "gemma2": BlockLayout(source="mlx_lm/models/gemma2.py", offset_norm=True,
                          activation="gelu_tanh",
                          softcap="attn_logit_softcapping", causal_array=True,
                          unfused=_SANDWICH, vetted=_calls(
                              "gemma2", Attention="db07bda6a260", MLP="fcd7015edea2",
                              TransformerBlock="2a2e6cf84e96")),
    # gpt_oss: attention sinks (a learned logit per head in the softmax, the brick's sinks),
    # q/k/v/o biases, sliding-window layers (window sliding_window, RotatingKVCache) where
    # layer_types says "sliding_attention" (default: every other layer), heads and scale under
    # their own names, YaRN RoPE (the module's own object). Every MLP is MoE: its SwitchGLU
    # experts are patched by module, router and combine stay stock.
    "gpt_oss": BlockLayout(source="mlx_lm/models/gpt_oss.py",
                           heads=("num_attention_heads", "num_key_value_heads"),
                           scale="sm_scale", sinks="sinks", window_arg="sliding_window",
                           layer_types="layer_types",
                           vetted=_calls("gpt_oss", AttentionBlock="4c91566d991a")),
    # qwen3_next / qwen3_5: full-attention layers (every full_attention_interval-th) gate
    # their output (q_proj gives each head's query then its gate; o_proj reads
    # attention * sigmoid(gate)), per-head q/k RMSNorm, partial RoPE (the module's own rope
    # object), heads under their own names. The other layers are Gated DeltaNet
    # (linear_attn, no self_attn): their mixer stays stock here, their MLP is patched. MoE
    # layers: SwitchGLU experts by module, the gated shared expert's MLP (shared_expert) as an
    # MLP piece, router and gate stock.
    "qwen3_next": BlockLayout(source="mlx_lm/models/qwen3_next.py",
                              qk_norm=("q_norm", "k_norm"),
                              heads=("num_attention_heads", "num_key_value_heads"),
                              output_gate=True, shared_expert="shared_expert",
                              vetted=_QWEN3_NEXT),
    "qwen3_5": BlockLayout(source="mlx_lm/models/qwen3_5.py", qk_norm=("q_norm", "k_norm"),
                           heads=("num_attention_heads", "num_key_value_heads"),
                           output_gate=True, shared_expert="shared_expert",
                           vetted=_QWEN3_NEXT),
    # gemma4 (text): sliding layers (is_sliding, head_dim, window sliding_window) and global
    # ones (global_head_dim 512, partial "proportional" RoPE: the module's own rope object),
    # plain nn.RMSNorm (q/k norms too), weightless v_norm, scale 1.0, values = keys on global
    # layers with attention_k_eq_v, the last num_kv_shared_layers layers attending over an
    # earlier layer's K/V (shared_kv: the attention returns (out, (keys, values), offset)),
    # GELU-tanh MLP. The decoder layer (sandwich norms, per-layer inputs, layer scalar, the
    # 26B's router and experts beside the MLP) stays its own: attention and MLP are patched
    # one by one, SwitchGLU experts by module.
    "gemma4_text": BlockLayout(source="mlx_lm/models/gemma4_text.py",
                               qk_norm=("q_norm", "k_norm"), activation="gelu_tanh",
                               sliding="is_sliding", window_arg="sliding_window",
                               shared_kv=True, unfused=_SANDWICH, vetted=_calls(
                                   "gemma4_text", Attention="ad9a3af24ad4",
                                   MLP="2472cd59629f")),
    # smollm3: llama's classes; its NoPE layers (no_rope_layers) hold an identity rope object
    # (smollm3.NoPE), which the bricks call like any rope: no RoPE on those layers.
    "smollm3": BlockLayout(source="mlx_lm/models/smollm3.py", vetted=_LLAMA),
    # seed_oss: qwen2's attention forward (q/k/v biases: attention_bias; o bias:
    # attention_out_bias), llama's block and MLP.
    "seed_oss": BlockLayout(source="mlx_lm/models/seed_oss.py", vetted=_calls(
        "seed_oss", Attention="b97fca5ccb66", MLP="07c9ab86cb8f",
        TransformerBlock="61ea9549fdd9")),
    # ministral3: llama's block with an attn_scale argument (Llama-4 query scaling: the model
    # computes 1 + beta * log(1 + floor(pos / original_max_position_embeddings)) per position
    # and the attention multiplies the roped queries by it), YaRN rope (the module's own
    # object), sliding-window layers (use_sliding, layer_types).
    "ministral3": BlockLayout(source="mlx_lm/models/ministral3.py", layer_sliding="use_sliding",
                              window_arg="sliding_window", query_scale="attn_scale",
                              call_args=("attn_scale", "mask", "cache"), vetted=_calls(
                                  "ministral3", Attention="c3248f2aeafd", MLP="07c9ab86cb8f",
                                  TransformerBlock="2a679626bf7b")),
    # olmo2: post-norm blocks; q/k RMSNorm over the full width (n_heads * head_dim) before the
    # head split.
    "olmo2": BlockLayout(source="mlx_lm/models/olmo2.py", qk_norm=("q_norm", "k_norm"),
                         qk_norm_width="full", unfused=_POST_NORM, vetted=_calls(
                             "olmo2", Attention="d8dfe3e56641", MLP="07c9ab86cb8f",
                             TransformerBlock="938036f56fc7")),
    # olmo3: olmo2's blocks and norms; layer_types "sliding_attention" (3 of 4 layers) get a
    # RotatingKVCache of sliding_window and mlx-lm's window mask; head counts spelled out.
    "olmo3": BlockLayout(source="mlx_lm/models/olmo3.py", qk_norm=("q_norm", "k_norm"),
                         qk_norm_width="full", unfused=_POST_NORM, layer_types="layer_types",
                         window_arg="sliding_window",
                         heads=("num_attention_heads", "num_key_value_heads"),
                         vetted=_calls("olmo3", Olmo3Attention="a1296d50727b",
                                       Olmo3MLP="fcbab3148610",
                                       Olmo3DecoderLayer="938036f56fc7")),
    # exaone4: post-norm blocks, per-head q/k norms; local layers (is_local: sliding window,
    # RoPE) and global layers without RoPE (use_rope False) when a sliding_window_pattern is
    # set.
    "exaone4": BlockLayout(source="mlx_lm/models/exaone4.py", qk_norm=("q_norm", "k_norm"),
                           unfused=_POST_NORM, sliding="is_local", window_arg="sliding_window",
                           rope_flag="use_rope", vetted=_calls(
                               "exaone4", Attention="4c8b7082aad5", MLP="07c9ab86cb8f",
                               TransformerBlock="7987ccdbd076")),
    # glm4_moe: partial RoPE (partial_rotary_factor: the module's own nn.RoPE over the first
    # dims), q/k/v biases, per-head q/k norms where use_qk_norm; MoE layers' routed experts
    # (SwitchGLU) are patched by module and their shared expert as an MLP.
    "glm4_moe": BlockLayout(source="mlx_lm/models/glm4_moe.py", qk_norm=("q_norm", "k_norm"),
                            qk_norm_flag="use_qk_norm", shared_expert="shared_experts",
                            vetted=_calls("glm4_moe", Attention="ea42bbe6ee7f",
                                          MLP="d28884f84783", DecoderLayer="dec68396d250")),
    # llama4_text: the MLP is feed_forward; a weightless per-head RMSNorm of q and k
    # (mx.fast.rms_norm(x, None, rms_norm_eps)) before RoPE where use_qk_norm; layers with
    # use_rope False (no_rope_layers) have no RoPE.
    "llama4_text": BlockLayout(source="mlx_lm/models/llama4_text.py", mlp="feed_forward",
                               inline_qk_norm="use_qk_norm", inline_qk_norm_eps="rms_norm_eps",
                               rope_flag="use_rope", vetted=_calls(
                                   "llama4_text", Attention="58158ceb5556",
                                   MLP="fcbab3148610", TransformerBlock="052e2522d61d")),
    # llama4 (the multimodal wrapper; its text model is llama4.py's, not llama4_text's): the MLP
    # is feed_forward (a MoE with a shared expert on interleave_moe_layer_step layers); RoPE
    # layers normalise q and k with a weightless RMSNorm (eps 1e-6) after RoPE and attend in
    # chunks (attention_chunk_size: ChunkedKVCache, a block-diagonal array mask: a call within
    # one chunk is plain causal and runs the brick, one across a chunk boundary runs stock);
    # every 4th layer has no RoPE and scales its queries by the attention temperature.
    # Attention and MLP are patched one by one.
    "llama4": BlockLayout(source="mlx_lm/models/llama4.py", mlp="feed_forward",
                          inline_qk_norm="use_qk_norm", inline_qk_norm_eps=1e-6,
                          inline_qk_norm_after_rope=True, rope_flag="use_rope",
                          query_scale="llama4_temperature", shared_expert="shared_expert",
                          chunked="use_rope", chunk_arg="attention_chunk_size",
                          unfused=("chunked attention (attention_chunk_size) on the RoPE "
                                   "layers runs stock across a chunk boundary: attention and "
                                   "MLP are patched one by one so the MLP runs its brick"),
                          vetted=_calls("llama4", Attention="57868f2054ac", MLP="07c9ab86cb8f",
                                        TransformerBlock="25dbc1ed7088")),
    # llama-shaped families whose forwards were read against the plain pre-norm layout:
    # internlm3 (llama's forwards verbatim; q/k/v/o biases with qkv_bias), helium (qwen2's
    # attention forward, traditional RoPE), nanbeige (the layer stack runs num_loops times
    # with shared weights: each call is a plain block), mellum (qwen3's attention forward,
    # MoE layers: experts by module; layer_types "sliding_attention" slide).
    "internlm3": BlockLayout(source="mlx_lm/models/internlm3.py", vetted=_calls(
        "internlm3", Attention="dc1cc3af5b0a", MLP="07c9ab86cb8f",
        TransformerBlock="61ea9549fdd9")),
    "helium": BlockLayout(source="mlx_lm/models/helium.py", vetted=_calls(
        "helium", HeliumAttention="b97fca5ccb66", HeliumMLP="fcbab3148610",
        HeliumDecoderLayer="61ea9549fdd9")),
    "nanbeige": BlockLayout(source="mlx_lm/models/nanbeige.py", vetted=_calls(
        "nanbeige", Attention="34620e412a2d", MLP="fcbab3148610",
        TransformerBlock="dec68396d250")),
    "mellum": BlockLayout(source="mlx_lm/models/mellum.py", qk_norm=("q_norm", "k_norm"),
                          layer_types="layer_types", window_arg="sliding_window",
                          vetted=_calls("mellum", Attention="0e5c13cbedb7",
                                        MellumDecoderLayer="dec68396d250")),
    # granite: llama's attention and MLP forwards (scale = attention_multiplier, the module's
    # own); the block multiplies each sublayer's output by residual_multiplier before the
    # residual add: attention and MLP are patched one by one (embedding and logits scaling
    # stay in the model's code).
    "granite": BlockLayout(source="mlx_lm/models/granite.py",
                           unfused=("the block scales each sublayer's output by "
                                    "residual_multiplier before the residual add: the unified "
                                    "block does not; attention and MLP are patched one by one"),
                           vetted=_calls("granite", Attention="dc1cc3af5b0a",
                                         MLP="07c9ab86cb8f")),
    # MoE families: olmoe (olmo2's full-width q/k norms in a pre-norm block; every layer's mlp
    # is MoE), dots1 (qwen3's attention forward; MoE layers from first_k_dense_replace with a
    # shared expert), exaone_moe (exaone4's attention forward: is_sliding_window layers slide
    # with RoPE, the others have none; pre-norm blocks; MoE layers with a shared expert).
    "olmoe": BlockLayout(source="mlx_lm/models/olmoe.py", qk_norm=("q_norm", "k_norm"),
                         qk_norm_width="full", vetted=_calls(
                             "olmoe", Attention="9e4decc7a683",
                             TransformerBlock="0ca9f3296226")),
    "dots1": BlockLayout(source="mlx_lm/models/dots1.py", qk_norm=("q_norm", "k_norm"),
                         shared_expert="shared_experts", vetted=_calls(
                             "dots1", Dots1Attention="0e5c13cbedb7", Dots1MLP="07c9ab86cb8f",
                             Dots1DecoderLayer="dec68396d250")),
    "exaone_moe": BlockLayout(source="mlx_lm/models/exaone_moe.py", qk_norm=("q_norm", "k_norm"),
                              sliding="is_sliding_window", window_arg="sliding_window",
                              rope_flag="use_rope", shared_expert="shared_experts",
                              vetted=_calls("exaone_moe", Attention="4c8b7082aad5",
                                            MLP="8b27d3a1b136", DecoderLayer="dec68396d250")),
    # Multi-head latent attention families (docs/mla.md): the MLA module (self_attn, or
    # Bailing's attention) is patched by module (patch.modules.MIXERS: bricks/mla), so these
    # entries are for the rest of the block: dense SwiGLU MLPs, MoE layers' shared experts
    # (SwitchGLU experts by module; routers stay stock). DeepSeek-V3.2's sparse attention
    # (indexer) is part of its MLA module.
    "deepseek_v2": BlockLayout(source="mlx_lm/models/deepseek_v2.py",
                               shared_expert="shared_experts",
                               vetted=_calls("deepseek_v2", DeepseekV2MLP="d28884f84783")),
    "deepseek_v3": BlockLayout(source="mlx_lm/models/deepseek_v3.py",
                               shared_expert="shared_experts", vetted=_DEEPSEEK_V3_MLP),
    "deepseek_v32": BlockLayout(source="mlx_lm/models/deepseek_v32.py",
                                shared_expert="shared_experts",
                                vetted=_calls("deepseek_v32", DeepseekV32MLP="d28884f84783")),
    "glm4_moe_lite": BlockLayout(source="mlx_lm/models/glm4_moe_lite.py",
                                 shared_expert="shared_experts",
                                 vetted=_calls("glm4_moe_lite", Glm4MoeLiteMLP="d28884f84783")),
    # mistral4 (the text model of mistral3's wrapper): DeepSeek-V3's MLP class
    "mistral4": BlockLayout(source="mlx_lm/models/mistral4.py", shared_expert="shared_experts",
                            call_args=("attn_scale", "mask", "cache"),
                            vetted=_DEEPSEEK_V3_MLP),
    "minicpm3": BlockLayout(source="mlx_lm/models/minicpm3.py",
                            vetted=_calls("minicpm3", MLP="8b27d3a1b136")),
    "youtu_llm": BlockLayout(source="mlx_lm/models/youtu_llm.py",
                             vetted=_calls("youtu_llm", YoutuLLMMLP="07c9ab86cb8f")),
    # longcat_flash: two MLA modules (self_attn[0], self_attn[1]) and two dense MLPs (mlps)
    # per layer around one MoE (mlp, identity "zero" experts); the MLA list has no single
    # attribute, so the entry names none ("mla_list"): its modules are patched by module.
    "longcat_flash": BlockLayout(source="mlx_lm/models/longcat_flash.py", attention="mla_list",
                                 mlp_list="mlps", vetted=_calls(
                                     "longcat_flash", LongcatFlashMLP="fcbab3148610")),
    # bailing_hybrid: its linear-attention layers are not MLA (stock here unless a mixer of
    # patch.modules takes them)
    "bailing_hybrid": BlockLayout(source="mlx_lm/models/bailing_hybrid.py",
                                  attention="attention", shared_expert="shared_experts",
                                  vetted=_calls("bailing_hybrid", MLP="fcbab3148610")),
    # Hybrid models with gated-delta mixers (patched by module: patch.modules.MIXERS, whatever
    # the entry; kimi_linear / kimi_k3 / bailing_moe_v3 keep a Kimi Delta Attention module or
    # an MLA module in the attention slot): these entries add their MLPs (MoE layers:
    # SwitchGLU experts by module, the shared expert as an MLP) and, for olmo_hybrid, the
    # full-attention layers. Their MLA modules are patched by module too (bricks/mla).
    # olmo_hybrid: Gated DeltaNet layers (linear_attn, pre-norm) and every 4th a full-attention
    # layer as olmo3's (post-norm, q/k RMSNorm over the full width, the module's own rope).
    "olmo_hybrid": BlockLayout(source="mlx_lm/models/olmo_hybrid.py",
                               qk_norm=("q_norm", "k_norm"), qk_norm_width="full",
                               unfused=_POST_NORM,
                               heads=("num_attention_heads", "num_key_value_heads"),
                               vetted=_calls("olmo_hybrid", Attention="c2cd52b867c7",
                                             MLP="55221eab7185")),
    "kimi_linear": BlockLayout(source="mlx_lm/models/kimi_linear.py", unfused=_KDA_HYBRID,
                               shared_expert="shared_experts",
                               vetted=_calls("kimi_linear", KimiMLP="fcbab3148610")),
    "bailing_moe_v3": BlockLayout(source="mlx_lm/models/bailing_moe_v3.py",
                                  attention="attention", unfused=_KDA_HYBRID,
                                  shared_expert="shared_experts",
                                  vetted=_calls("bailing_moe_v3", BailingMLP="fcbab3148610")),
    # kimi_k3: its MLPs, shared experts and routed experts use SiTU (beta tanh(g / beta)
    # sigmoid(g) x), which no brick computes: they stay stock with the reason (the MLP
    # forward is not vetted); its KDA mixers run the brick.
    "kimi_k3": BlockLayout(source="mlx_lm/models/kimi_k3.py", unfused=_KDA_HYBRID,
                           shared_expert="shared_experts", vetted=()),
    # State-space and short-conv hybrids (issue 42): their Mamba-2 mixers and LFM2's short
    # convolutions are patched by module (patch.modules.MIXERS: the ssd and short_conv bricks);
    # these entries add the attention layers and dense MLPs (MoE experts by module). Every layer
    # branches between mixer kinds or scales its sublayers: attention and MLP one by one.
    # granitemoehybrid (Granite 4.0-H): NoPE attention (position_embedding_type "nope": rope
    # None) scaled by attention_multiplier, residual_multiplier on each sublayer; dense models'
    # MLP is mlp, MoE models' SwitchGLU experts are patched by module and their shared MLP
    # (shared_mlp: gate and up fused in input_linear) stays stock (no fused gate|up piece).
    "granitemoehybrid": BlockLayout(source="mlx_lm/models/granitemoehybrid.py", rope_flag="rope",
                                    unfused=_HYBRID, vetted=_calls(
                                        "granitemoehybrid",
                                        GraniteMoeHybridAttention="0940d56c22dd",
                                        GraniteMoeHybridMLP="07c9ab86cb8f")),
    # falcon_h1: attention and Mamba-2 in parallel on every layer (both read the input norm),
    # then the SwiGLU feed_forward after pre_ff_layernorm.
    "falcon_h1": BlockLayout(source="mlx_lm/models/falcon_h1.py", mlp="feed_forward",
                             post_attention_norm="pre_ff_layernorm",
                             heads=("num_heads", "num_kv_heads"), unfused=_HYBRID,
                             vetted=_calls("falcon_h1", FalconH1Attention="17265f406c52",
                                           FalconH1MLP="746053e54426")),
    # lfm2 / lfm2_moe: short-conv layers and attention layers (per-head q/k RMSNorm named
    # q_layernorm / k_layernorm before RoPE, out_proj), operator_norm / ffn_norm; lfm2's MLP is
    # w1 (gate), w3 (up), w2 (down); lfm2_moe's first num_dense_layers are llama's MLP, the
    # rest SwitchGLU experts (by module; router stock).
    "lfm2": BlockLayout(source="mlx_lm/models/lfm2.py", mlp="feed_forward",
                        input_norm="operator_norm", post_attention_norm="ffn_norm",
                        o_proj="out_proj", gate_proj="w1", up_proj="w3", down_proj="w2",
                        qk_norm=("q_layernorm", "k_layernorm"), unfused=_HYBRID,
                        vetted=_calls("lfm2", Attention="d63a2515d102", MLP="93c828a3e0be")),
    "lfm2_moe": BlockLayout(source="mlx_lm/models/lfm2_moe.py", mlp="feed_forward",
                            input_norm="operator_norm", post_attention_norm="ffn_norm",
                            o_proj="out_proj", qk_norm=("q_layernorm", "k_layernorm"),
                            unfused=_HYBRID, vetted=_calls(
                                "lfm2_moe", Attention="d63a2515d102", MLP="07c9ab86cb8f")),
    # jamba: NoPE attention layers and Mamba-1 layers (by module: the selective-scan brick),
    # feed_forward a SwiGLU MLP or a MoE block (SwitchGLU experts by module).
    "jamba": BlockLayout(source="mlx_lm/models/jamba.py", mlp="feed_forward",
                         post_attention_norm="pre_ff_layernorm", rope_flag="rope",
                         heads=("num_attention_heads", "num_key_value_heads"), unfused=_HYBRID,
                         vetted=_calls("jamba", JambaAttention="0447a1770e60",
                                       JambaMLP="fcbab3148610")),
}

# model_type -> ARCHITECTURES key, for types mlx-lm builds with another type's model file
# (mlx_lm.utils.MODEL_REMAPPING maps "mistral", "xverse" and "iquestcoder" to llama.py).
# "gemma3" is the multimodal wrapper: model.layers are gemma3_text's (language_model.layers).
# "qwen3_5_moe" builds qwen3_5's model (its Model subclasses qwen3_5's, same layers).
# "gemma4" is the multimodal wrapper: model.layers are gemma4_text's.
# "glm_moe_dsa" (GLM-5) builds deepseek_v32's model (its Model subclasses DeepSeek-V3.2's);
# "longcat_flash_ngram" stacks longcat_flash's decoder layers (n-gram embeddings in front).
ALIASES: dict[str, str] = {"mistral": "llama", "xverse": "llama", "iquestcoder": "llama",
                           "gemma3": "gemma3_text", "qwen3_5_moe": "qwen3_5",
                           "gemma4": "gemma4_text", "glm_moe_dsa": "deepseek_v32",
                           "longcat_flash_ngram": "longcat_flash"}

#: Multimodal wrappers whose text model (``model.language_model``) may be of several types
#: (mistral3: llama, ministral3 or mistral4): looked up by the text model's ``model_type``.
#: mlx-lm builds "llava" with mistral3.py.
WRAPPERS: tuple[str, ...] = ("mistral3", "llava")


def model_args(model):
    """The text model's args: ``model.args``, or the wrapped ``language_model.args``."""
    lm = getattr(model, "language_model", None)
    return getattr(lm if lm is not None else model, "args", None)


def layer_types(model, field: str):
    """The per-layer attention types of ``model``: its args' ``field``, else its inner
    model's attribute (gpt-oss fills the default alternation there), else None."""
    types = getattr(model_args(model), field, None)
    if types is None:
        lm = getattr(model, "language_model", model)
        types = getattr(getattr(lm, "model", None), field, None)
    return types if isinstance(types, (list, tuple)) else None


def bind(layout: BlockLayout, model) -> BlockLayout:
    """``layout`` with the values one model sets: the sliding-window length from its args'
    ``layout.window_arg``, the attention chunk length from ``layout.chunk_arg`` (each None if
    absent or not a positive int). Which layers slide is decided per layer at patch time
    (``patch.core.layer_sliding``)."""
    if model is None:
        return layout

    def positive(field):
        value = getattr(model_args(model), field, None) if field is not None else None
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0
        return int(value) if ok else None

    if layout.window_arg is not None:
        layout = dataclasses.replace(layout, sliding_window=positive(layout.window_arg))
    if layout.chunk_arg is not None:
        layout = dataclasses.replace(layout, chunk_size=positive(layout.chunk_arg))
    return layout


def lookup(model_type, model=None) -> tuple[str | None, BlockLayout | None]:
    """``(architecture name, layout)`` for ``model_type``, or ``(None, None)`` if unsupported;
    with ``model``, the layout is bound to it (:func:`bind`). A wrapper type (:data:`WRAPPERS`)
    takes the entry of ``model.language_model.model_type`` (none without ``model``)."""
    if not isinstance(model_type, str):
        return None, None
    if model_type in WRAPPERS:
        model_type = getattr(getattr(model, "language_model", None), "model_type", None)
        if not isinstance(model_type, str) or model_type in WRAPPERS:
            return None, None
    name = ALIASES.get(model_type, model_type)
    layout = ARCHITECTURES.get(name)
    return (name, bind(layout, model)) if layout is not None else (None, None)


def supported_model_types() -> tuple[str, ...]:
    """mlx-lm ``model_type`` values the patch knows (architectures and their aliases), sorted."""
    return tuple(sorted([*ARCHITECTURES, *ALIASES, *WRAPPERS]))
