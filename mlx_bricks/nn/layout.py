"""``BlockLayout``: where an mlx-lm decoder block keeps its parts, and the architecture facts the
patched modules need (one entry per architecture in ``mlx_bricks.patch.table``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockLayout:
    """Where an mlx-lm pre-norm decoder block keeps its parts (attribute names), and the facts
    of its architecture.

    The block computes ``h = x + attn(input_norm(x)); out = h + mlp(post_attention_norm(h))``;
    the attention projects with q/k/v/o ``nn.Linear`` or ``nn.QuantizedLinear`` (MLX affine)
    layers (biases optional), optionally applies per-head RMSNorms (``qk_norm``, qwen3) before
    RoPE, and the MLP is ``down(act(gate(x)) * up(x))`` with ``act`` the layout's
    ``activation``.

    Architecture facts:
        source: the mlx-lm model file (``mlx_lm/models/llama.py``); its module is where an
            ``offset_norm`` architecture defines its ``RMSNorm`` class.
        offset_norm: the model's RMSNorms compute ``mx.fast.rms_norm(x, 1 + weight, eps)``
            (gemma: the checkpoint stores ``w - 1``) with the model file's own ``RMSNorm``
            class; False: ``nn.RMSNorm``.
        layer_sliding: attribute of a decoder layer that is True on a sliding-window layer
            (llama's, ministral3's ``use_sliding``: those layers get a ``RotatingKVCache`` of
            ``window_arg`` and mlx-lm's window mask); None: no such attribute.
        activation: the MLP's gate activation, ``"silu"`` or ``"gelu_tanh"`` (gemma's
            ``nn.gelu_approx``; ``bricks.swiglu.variants.ACTIVATIONS``).
        sliding: attribute of the attention module that is True on sliding-window layers the
            attention brick runs with a window (gemma3: ``is_sliding``); None: none.
        window_arg: field of the model's args that holds the window length
            (``sliding_window``); :func:`mlx_bricks.patch.table.lookup` copies its value into
            ``sliding_window`` for one model.
        sliding_window: the window length (keys each query sees, itself included), or None
            while unknown (sliding layers then run stock, with the reason).
        unfused: why the unified block (``BricksBlock``) does not apply to this architecture
            (None: it does); attention and MLP are then patched one by one.
        softcap: attribute of the attention module that holds the logit soft-cap
            (gemma2: ``attn_logit_softcapping``, ``cap * tanh(s / cap)``); None: no soft-cap.
        causal_array: the model passes its causal mask as mlx-lm's boolean
            ``create_causal_mask`` array (gemma2: ``return_array=True``), taken as causal.
        layer_types: field of the model's args listing each layer's type; a layer whose type
            is ``"sliding_attention"`` is a sliding-window layer (olmo3); None: not used.
        heads: the attention module's attributes holding the query and KV head counts
            (``("n_heads", "n_kv_heads")``; olmo3 spells them ``num_attention_heads`` /
            ``num_key_value_heads``).
        qk_norm_width: ``"head"``: ``qk_norm`` normalises each head's head_dim values (qwen3);
            ``"full"``: all heads' values of a token together, before the head split (olmo2,
            olmo3: ``q_norm`` has ``n_heads * head_dim`` weights).
        qk_norm_flag: attribute of the attention module that is False where the module has
            no ``qk_norm`` modules (glm4_moe's ``use_qk_norm``); None: always present.
        inline_qk_norm: attribute of the attention module that is True where its forward
            normalises q and k per head with a weightless ``mx.fast.rms_norm(x, None, eps)``
            (llama4's ``use_qk_norm``); None: no such step.
        inline_qk_norm_eps: that norm's eps: a number, or the attention module's attribute
            that holds it (llama4_text: ``"rms_norm_eps"``).
        inline_qk_norm_after_rope: the weightless norm comes after RoPE (llama4) instead of
            before it (llama4_text).
        rope_flag: attribute of the attention module that is False on a layer without RoPE
            (NoPE: llama4's, exaone4's ``use_rope``; such a module has no ``rope``); None: every
            layer has its ``rope`` (smollm3's NoPE layers have an identity ``rope`` object).
        query_scale: ``"attn_scale"``: the module's call takes an ``attn_scale`` array (one
            factor per position, shape (L, 1)) that multiplies the queries after RoPE
            (ministral3: Llama-4 query scaling); ``"llama4_temperature"``: on a NoPE layer
            with ``attn_temperature_tuning``, the module scales its queries by
            ``1 + attn_scale * log(1 + floor(position / floor_scale))`` (llama4); None: none.
        chunked: attribute of the attention module that is True where it attends in chunks
            (llama4's RoPE layers, ``use_rope``: a ``ChunkedKVCache`` and a block-diagonal
            array mask, which the attention brick does not take): such modules stay stock;
            None: none.
        call_args: the parameters of the attention's and block's ``__call__`` after ``x``
            (``("mask", "cache")``; ministral3: ``("attn_scale", "mask", "cache")``).
        shared_expert: attribute of a MoE layer's sparse block holding a dense shared expert
            MLP (glm4_moe's ``shared_experts``) patched as an MLP; None: none.
        vetted: ``"<module>.<Class>.__call__=<sha256 prefix>"`` of each mlx-lm forward this
            entry was checked against (``mlx_bricks.patch.vetted``): a block, attention or MLP
            whose ``__call__`` is not one of them stays stock with the reason.
    """

    source: str
    attention: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    qk_norm: tuple[str, str] | None = None
    offset_norm: bool = False
    layer_sliding: str | None = None
    activation: str = "silu"
    sliding: str | None = None
    window_arg: str | None = None
    sliding_window: int | None = None
    unfused: str | None = None
    softcap: str | None = None
    causal_array: bool = False
    layer_types: str | None = None
    heads: tuple[str, str] = ("n_heads", "n_kv_heads")
    qk_norm_width: str = "head"
    qk_norm_flag: str | None = None
    inline_qk_norm: str | None = None
    inline_qk_norm_eps: str | float = 1e-6
    inline_qk_norm_after_rope: bool = False
    rope_flag: str | None = None
    query_scale: str | None = None
    chunked: str | None = None
    call_args: tuple[str, ...] = ("mask", "cache")
    shared_expert: str | None = None
    vetted: tuple[str, ...] = ()

    @property
    def attention_linears(self) -> tuple[str, str, str, str]:
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    @property
    def mlp_linears(self) -> tuple[str, str, str]:
        return (self.gate_proj, self.up_proj, self.down_proj)

    def head_counts(self, attn) -> tuple[int, int]:
        """``(n_heads, n_kv_heads)`` of an attention module (None where missing)."""
        return getattr(attn, self.heads[0], None), getattr(attn, self.heads[1], None)

    def has_qk_norm(self, attn) -> bool:
        """Whether ``attn`` normalises q and k with its ``qk_norm`` modules."""
        return self.qk_norm is not None and (
            self.qk_norm_flag is None or bool(getattr(attn, self.qk_norm_flag, False)))

    def has_rope(self, attn) -> bool:
        """Whether ``attn`` applies its ``rope`` (False on a ``rope_flag`` NoPE layer)."""
        return self.rope_flag is None or bool(getattr(attn, self.rope_flag, False))

    @property
    def module(self) -> str:
        """The model file's module name (``mlx_lm.models.llama``)."""
        return self.source.removesuffix(".py").replace("/", ".")
