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
        heads: attributes of the attention module holding the query and KV head counts
            (mlx-lm's llama: ``n_heads``, ``n_kv_heads``; gpt-oss, qwen3_next, olmo3:
            ``num_attention_heads``, ``num_key_value_heads``).
        scale: attribute of the attention module holding the score scale (gpt-oss:
            ``sm_scale``).
        sinks: attribute of the attention module holding its (n_heads,) attention-sink logits
            (gpt-oss: ``sinks``, passed to the attention brick); None: a module that has a
            ``sinks`` array stays stock.
        output_gate: the attention's output is gated (qwen3_next, qwen3_5): ``q_proj`` gives,
            per head, ``head_dim`` query columns then ``head_dim`` gate columns, and
            ``o_proj`` reads ``attention * sigmoid(gate)``.
        layer_types: field of the model's args (else attribute of its inner model: gpt-oss
            fills the default alternation there) listing each layer's attention type; a layer
            whose type is ``"sliding_attention"`` runs with ``sliding_window`` (gpt-oss, olmo3,
            mellum). Resolved per layer at patch time (``patch.core.layer_sliding`` into
            ``BricksState.sliding``); a model without the list keeps those attentions stock,
            with the reason. None: not used.
        shared_kv: the attention is gemma4's: called ``(x, mask, cache, shared_kv=None,
            offset=None)``, it returns ``(out, (keys, values), offset)``; a layer whose
            ``has_kv`` attribute is False has no k/v projections and attends over the
            ``shared_kv`` of an earlier layer (mlx-lm's ``num_kv_shared_layers``); where the
            ``k_eq_v`` attribute is True there is no ``v_proj`` (values are the raw key
            projection); values go through the weightless ``v_norm``.
        has_kv, k_eq_v, v_norm: the attention module's attributes of the above (``shared_kv``
            only).
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
            layer has its ``rope`` (smollm3's NoPE layers have an identity ``rope`` object);
            ``"rope"``: NoPE where the module's ``rope`` is None or missing (granitemoehybrid's
            ``position_embedding_type="nope"``, nemotron_h).
        query_scale: ``"attn_scale"``: the module's call takes an ``attn_scale`` array (one
            factor per position, shape (L, 1)) that multiplies the queries after RoPE
            (ministral3: Llama-4 query scaling); ``"llama4_temperature"``: on a NoPE layer
            with ``attn_temperature_tuning``, the module scales its queries by
            ``1 + attn_scale * log(1 + floor(position / floor_scale))`` (llama4); None: none.
        chunked: attribute of the attention module that is True where it attends in chunks
            (llama4's RoPE layers, ``use_rope``: a ``ChunkedKVCache`` and a block-diagonal
            array mask); a call whose queries and keys all lie in one chunk is plain causal
            and runs the brick, one that crosses a chunk boundary runs stock
            (``nn.calls.chunked_reason``); None: none.
        chunk_arg: field of the model's args with the chunk length (``attention_chunk_size``);
            :func:`mlx_bricks.patch.table.bind` copies its value into ``chunk_size``.
        chunk_size: the chunk length in tokens, or None (chunked modules then stay stock).
        call_args: the parameters of the attention's and block's ``__call__`` after ``x``
            (``("mask", "cache")``; ministral3: ``("attn_scale", "mask", "cache")``).
        shared_expert: attribute of a MoE layer's sparse block (one holding ``SwitchGLU`` /
            ``SwitchMLP`` experts) holding its dense shared expert, a plain MLP of the layout's
            linears whose output the block combines itself (glm4_moe, dots1: ``shared_experts``;
            qwen3_next: ``shared_expert``, gated by ``sigmoid(shared_expert_gate(x))``): patched
            as an MLP piece, reported as ``<mlp>.<shared_expert>``; None: none.
        mlp_list: attribute of the decoder layer holding a list of further dense MLPs of the
            layout's linears (LongCat-Flash's ``mlps``, beside its MoE ``mlp``), each patched
            as an MLP piece, reported as ``<mlp_list>.<j>``; None: none.
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
    heads: tuple[str, str] = ("n_heads", "n_kv_heads")
    scale: str = "scale"
    sinks: str | None = None
    output_gate: bool = False
    layer_types: str | None = None
    shared_kv: bool = False
    has_kv: str = "has_kv"
    k_eq_v: str = "use_k_eq_v"
    v_norm: str = "v_norm"
    qk_norm_width: str = "head"
    qk_norm_flag: str | None = None
    inline_qk_norm: str | None = None
    inline_qk_norm_eps: str | float = 1e-6
    inline_qk_norm_after_rope: bool = False
    rope_flag: str | None = None
    query_scale: str | None = None
    chunked: str | None = None
    chunk_arg: str | None = None
    chunk_size: int | None = None
    call_args: tuple[str, ...] = ("mask", "cache")
    shared_expert: str | None = None
    mlp_list: str | None = None
    vetted: tuple[str, ...] = ()

    @property
    def attention_linears(self) -> tuple[str, str, str, str]:
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    @property
    def mlp_linears(self) -> tuple[str, str, str]:
        return (self.gate_proj, self.up_proj, self.down_proj)

    def owns_kv(self, attn) -> bool:
        """Whether the attention module projects its own keys and values (always, except a
        ``shared_kv`` layer whose ``has_kv`` is False)."""
        return not self.shared_kv or bool(getattr(attn, self.has_kv, False))

    def attention_linears_of(self, attn) -> tuple[str, ...]:
        """The projections this attention module has: all four, except that a ``shared_kv``
        layer without its own K/V has only q/o, and one with ``k_eq_v`` has no v."""
        if not self.shared_kv:
            return self.attention_linears
        if not self.owns_kv(attn):
            return (self.q_proj, self.o_proj)
        if getattr(attn, self.k_eq_v, False):
            return (self.q_proj, self.k_proj, self.o_proj)
        return self.attention_linears

    def qk_norms_of(self, attn) -> tuple[str, ...]:
        """The per-head norms this attention module applies (k's only where it owns K/V)."""
        if not self.has_qk_norm(attn):
            return ()
        return self.qk_norm if self.owns_kv(attn) else self.qk_norm[:1]

    def scale_of(self, attn):
        """The attention module's score scale (None if it has none)."""
        return getattr(attn, self.scale, None)

    def sinks_of(self, attn):
        """The attention module's sink logits (``sinks`` set), else None."""
        return None if self.sinks is None else getattr(attn, self.sinks, None)

    def head_counts(self, attn) -> tuple[int, int]:
        """``(n_heads, n_kv_heads)`` of an attention module (None where missing)."""
        return getattr(attn, self.heads[0], None), getattr(attn, self.heads[1], None)

    def has_qk_norm(self, attn) -> bool:
        """Whether ``attn`` normalises q and k with its ``qk_norm`` modules (``qk_norm`` set
        and, with ``qk_norm_flag``, the module's flag True)."""
        return self.qk_norm is not None and (
            self.qk_norm_flag is None or bool(getattr(attn, self.qk_norm_flag, False)))

    def has_rope(self, attn) -> bool:
        """Whether ``attn`` applies its ``rope`` (False on a ``rope_flag`` NoPE layer: a false
        flag, or a ``"rope"`` attribute that is None or missing)."""
        flag = getattr(attn, self.rope_flag, None) if self.rope_flag else True
        return flag is not None and (callable(flag) or bool(flag))

    @property
    def module(self) -> str:
        """The model file's module name (``mlx_lm.models.llama``)."""
        return self.source.removesuffix(".py").replace("/", ".")
