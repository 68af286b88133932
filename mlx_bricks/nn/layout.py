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
        layer_sliding: attribute of a decoder layer that is True on a sliding-window layer the
            patch leaves stock (llama's ``use_sliding``: its layers get a ``RotatingKVCache``);
            None: no such layers.
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
            (mlx-lm's llama: ``n_heads``, ``n_kv_heads``; gpt-oss, qwen3_next:
            ``num_attention_heads``, ``num_key_value_heads``).
        scale: attribute of the attention module holding the score scale (gpt-oss:
            ``sm_scale``).
        sinks: attribute of the attention module holding its (n_heads,) attention-sink logits
            (gpt-oss: ``sinks``, passed to the attention brick); None: a module that has a
            ``sinks`` array stays stock.
        output_gate: the attention's output is gated (qwen3_next, qwen3_5): ``q_proj`` gives,
            per head, ``head_dim`` query columns then ``head_dim`` gate columns, and
            ``o_proj`` reads ``attention * sigmoid(gate)``.
        layer_types: field of the model's args (or attribute of its inner model) listing
            each layer's attention type (gpt-oss: ``layer_types``); layers whose entry is
            ``"sliding_attention"`` run with ``sliding_window``. :func:`mlx_bricks.patch.table.
            bind` resolves it into ``sliding_layers`` for one model.
        sliding_layers: indices of the sliding-window layers (bound from ``layer_types``), or
            None while unknown (then every layer of a ``layer_types`` layout runs stock, with
            the reason).
        shared_expert: attribute of a MoE block holding its shared expert, a plain MLP of the
            layout's linears whose output the block gates itself (qwen3_next:
            ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``): patched as an MLP piece;
            None: left as the block runs it.
        shared_kv: the attention is gemma4's: called ``(x, mask, cache, shared_kv=None,
            offset=None)``, it returns ``(out, (keys, values), offset)``; a layer whose
            ``has_kv`` attribute is False has no k/v projections and attends over the
            ``shared_kv`` of an earlier layer (mlx-lm's ``num_kv_shared_layers``); where the
            ``k_eq_v`` attribute is True there is no ``v_proj`` (values are the raw key
            projection); values go through the weightless ``v_norm``.
        has_kv, k_eq_v, v_norm: the attention module's attributes of the above (``shared_kv``
            only).
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
    sliding_layers: frozenset | None = None
    shared_expert: str | None = None
    shared_kv: bool = False
    has_kv: str = "has_kv"
    k_eq_v: str = "use_k_eq_v"
    v_norm: str = "v_norm"

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
        if self.qk_norm is None:
            return ()
        return self.qk_norm if self.owns_kv(attn) else self.qk_norm[:1]

    def n_heads(self, attn):
        """The attention module's query head count (None if it has none)."""
        return getattr(attn, self.heads[0], None)

    def n_kv_heads(self, attn):
        """The attention module's KV head count (None if it has none)."""
        return getattr(attn, self.heads[1], None)

    def scale_of(self, attn):
        """The attention module's score scale (None if it has none)."""
        return getattr(attn, self.scale, None)

    def sinks_of(self, attn):
        """The attention module's sink logits (``sinks`` set), else None."""
        return None if self.sinks is None else getattr(attn, self.sinks, None)

    @property
    def module(self) -> str:
        """The model file's module name (``mlx_lm.models.llama``)."""
        return self.source.removesuffix(".py").replace("/", ".")
