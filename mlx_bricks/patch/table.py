"""What each supported mlx-lm architecture's decoder block looks like.

One entry per ``model_type`` (mlx-lm's ``config.json`` field); the patch routine is the same for
all of them. Biases are found on the modules themselves (qwen2 has q/k/v biases, llama has them
with ``attention_bias``/``mlp_bias``), so they need no entry here. Neither do MoE experts: every
mlx-lm ``SwitchGLU`` is patched by module, whatever the model_type (``patch.core``
``_patch_experts``, ``bricks/moe/piece.py``), nor Gated DeltaNet mixers: qwen3_5 / qwen3_5_moe /
qwen3_next's are patched by module whatever the model_type (``patch.core._patch_gated_delta``,
``bricks/gated_delta/piece.py``); a model_type not listed here keeps its attention and dense MLPs
stock.
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

ARCHITECTURES: dict[str, BlockLayout] = {
    # llama: layers with use_sliding (layer_types "sliding_attention") get a RotatingKVCache.
    "llama": BlockLayout(source="mlx_lm/models/llama.py", layer_sliding="use_sliding"),
    "qwen2": BlockLayout(source="mlx_lm/models/qwen2.py"),
    # qwen3: per-head RMSNorm of q and k (over head_dim) before RoPE.
    "qwen3": BlockLayout(source="mlx_lm/models/qwen3.py", qk_norm=("q_norm", "k_norm")),
    # qwen3_moe / qwen2_moe: qwen3's / qwen2's attention; a MoE layer's mlp is a sparse block
    # (router, SwitchGLU experts, qwen2_moe's shared expert): those layers are not fused, their
    # experts are patched by module.
    "qwen3_moe": BlockLayout(source="mlx_lm/models/qwen3_moe.py", qk_norm=("q_norm", "k_norm")),
    "qwen2_moe": BlockLayout(source="mlx_lm/models/qwen2_moe.py"),
    # gemma3 (text): RMSNorm of 1 + w (q/k norms too), GELU-tanh MLP, scale from
    # query_pre_attn_scalar (the module's own scale), sliding-window layers (is_sliding, a
    # RotatingKVCache of sliding_window) between global ones; embedding scaling stays in the
    # model's own code (outside the layers).
    "gemma3_text": BlockLayout(source="mlx_lm/models/gemma3_text.py",
                               qk_norm=("q_norm", "k_norm"), offset_norm=True,
                               activation="gelu_tanh",
                               sliding="is_sliding", window_arg="sliding_window",
                               unfused=_SANDWICH),
    # gemma2: 1 + w RMSNorms, GELU-tanh MLP, attention logit soft-capping
    # (attn_logit_softcapping), the causal mask passed as an array (return_array=True). mlx-lm's
    # gemma2 has no sliding-window layers (every layer attends globally), so neither do we.
    "gemma2": BlockLayout(source="mlx_lm/models/gemma2.py", offset_norm=True,
                          activation="gelu_tanh",
                          softcap="attn_logit_softcapping", causal_array=True,
                          unfused=_SANDWICH),
    # gpt_oss: attention sinks (a learned logit per head in the softmax, the brick's sinks),
    # q/k/v/o biases, sliding-window layers (window sliding_window, RotatingKVCache) where
    # layer_types says "sliding_attention" (default: every other layer), heads and scale under
    # their own names, YaRN RoPE (the module's own object). Every MLP is MoE: its SwitchGLU
    # experts are patched by module, router and combine stay stock.
    "gpt_oss": BlockLayout(source="mlx_lm/models/gpt_oss.py",
                           heads=("num_attention_heads", "num_key_value_heads"),
                           scale="sm_scale", sinks="sinks", window_arg="sliding_window",
                           layer_types="layer_types"),
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
                              output_gate=True, shared_expert="shared_expert"),
    "qwen3_5": BlockLayout(source="mlx_lm/models/qwen3_5.py", qk_norm=("q_norm", "k_norm"),
                           heads=("num_attention_heads", "num_key_value_heads"),
                           output_gate=True, shared_expert="shared_expert"),
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
                               shared_kv=True, unfused=_SANDWICH),
}

# model_type -> ARCHITECTURES key, for types mlx-lm builds with another type's model file
# (mlx_lm.utils.MODEL_REMAPPING maps "mistral" to llama.py).
# "gemma3" is the multimodal wrapper: model.layers are gemma3_text's (language_model.layers).
# "qwen3_5_moe" builds qwen3_5's model (its Model subclasses qwen3_5's, same layers).
# "gemma4" is the multimodal wrapper: model.layers are gemma4_text's.
ALIASES: dict[str, str] = {"mistral": "llama", "gemma3": "gemma3_text", "qwen3_5_moe": "qwen3_5",
                           "gemma4": "gemma4_text"}


def _model_args(model):
    """The text model's args: ``model.args``, or the wrapped ``language_model.args``."""
    lm = getattr(model, "language_model", None)
    return getattr(lm if lm is not None else model, "args", None)


def _layer_types(model, field: str):
    """The per-layer attention types of ``model``: its args' ``field``, else its inner
    model's attribute (gpt-oss fills the default alternation there), else None."""
    types = getattr(_model_args(model), field, None)
    if types is None:
        lm = getattr(model, "language_model", model)
        types = getattr(getattr(lm, "model", None), field, None)
    return types if isinstance(types, (list, tuple)) else None


def bind(layout: BlockLayout, model) -> BlockLayout:
    """``layout`` with the values one model sets: the sliding-window length from its args'
    ``layout.window_arg`` (None if absent or not a positive int) and, with
    ``layout.layer_types``, the indices of its ``"sliding_attention"`` layers (None if the
    model has no such list)."""
    if model is None:
        return layout
    if layout.window_arg is not None:
        window = getattr(_model_args(model), layout.window_arg, None)
        ok = isinstance(window, numbers.Integral) and not isinstance(window, bool) and window > 0
        layout = dataclasses.replace(layout, sliding_window=int(window) if ok else None)
    if layout.layer_types is not None:
        types = _layer_types(model, layout.layer_types)
        sliding = None if types is None else frozenset(
            i for i, t in enumerate(types) if t == "sliding_attention")
        layout = dataclasses.replace(layout, sliding_layers=sliding)
    return layout


def lookup(model_type, model=None) -> tuple[str | None, BlockLayout | None]:
    """``(architecture name, layout)`` for ``model_type``, or ``(None, None)`` if unsupported;
    with ``model``, the layout is bound to it (:func:`bind`)."""
    if not isinstance(model_type, str):
        return None, None
    name = ALIASES.get(model_type, model_type)
    layout = ARCHITECTURES.get(name)
    return (name, bind(layout, model)) if layout is not None else (None, None)


def supported_model_types() -> tuple[str, ...]:
    """mlx-lm ``model_type`` values the patch knows (architectures and their aliases), sorted."""
    return tuple(sorted([*ARCHITECTURES, *ALIASES]))
