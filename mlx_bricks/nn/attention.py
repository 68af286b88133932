"""``BricksAttention``: an mlx-lm attention module with its prefill on the GEMM and attention
bricks, and what the attention and block mixins share (call admission, the attention step)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.attention import piece as attention_piece
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.norm_qkv.piece import heads

from mlx_bricks.nn.calls import (cache_offset, call_args, call_reason, is_q8_cache,
                                 layer_window, mask_key, split_call)
from mlx_bricks.nn.runner import (BricksState, all_stock, check_block, choose, run_piece,
                                  stock_fast)
from mlx_bricks.nn.structure import structure_reason
from mlx_bricks.runtime.kind import Act


def admit(module, state: BricksState, attn, x, mask, cache, args, kwargs, extra=None,
          keys=None):
    """The call checks shared by the attention and block mixins (``attn``: the attention
    module, ``module`` itself for the attention mixin).

    Returns ``(stock, window, shape_key, q8)``: ``stock`` True when the call runs the module's
    own code, either counted with its reason here or through the all-stock fast path
    (``runner.stock_fast``); otherwise the layer's sliding window, the call-shape key of the
    dispatcher's memos and whether the cache is a ``Q8KVCache`` (whose attention is the Q8_0
    readers, untuned). ``extra``: the layout's call arguments besides mask and cache
    (``{"attn_scale": array}``). ``keys``: the key count where the keys do not come from
    ``cache`` (gemma4's shared K/V; part of the call shape then).
    """
    lay = state.layout
    window, reason = layer_window(attn, lay, state.sliding)
    chunk = lay.chunk_size if lay.chunked and getattr(attn, lay.chunked, False) else None
    reason = reason or call_reason(x, mask, cache, args, kwargs, window, lay.causal_array,
                                   keys, chunk)
    if reason is None and state.layout.query_scale == "attn_scale":
        reason = _attn_scale_reason((extra or {}).get("attn_scale"), x)
    shape_key = q8 = None
    if reason is None:
        offset = cache_offset(cache)
        q8 = cache is not None and is_q8_cache(cache)
        shape_key = (x.shape, x.dtype, offset, mask_key(mask, cache, x.shape[1], keys), q8,
                     keys)
        if stock_fast(state, shape_key):
            return True, window, shape_key, q8
        reason = structure_reason(module, state, x.dtype)
    if reason is not None:
        state.stock[reason] += 1
        return True, window, shape_key, q8
    return False, window, shape_key, q8


def _attn_scale_reason(scale, x) -> str | None:
    """Why the ``attn_scale`` argument is not the (L, 1) per-position query factor the model
    passes (None: it is)."""
    L = x.shape[1]
    if isinstance(scale, mx.array) and tuple(scale.shape) == (L, 1):
        return None
    what = f"an array {tuple(scale.shape)}" if isinstance(scale, mx.array) else repr(scale)
    return f"attn_scale is {what}, not the model's ({L}, 1) query scaling: stock"


def attention_args(attn, state: BricksState, B, L, cache, dtype, mask, window):
    """The attention piece's arguments (shapes only) for this module and call."""
    return attention_piece.attention_args(attn, state.layout, B, L, cache, dtype, mask,
                                          head_dim=state.head_dim, kv_quant=state.kv_quant,
                                          window=window)


def _full_width(norm, t):
    """``norm`` over all heads' values of a token (olmo2's q_norm over n_heads * head_dim), on
    ``t`` in head layout (B, H, L, hd), as the module applies it before the head split."""
    B, H, L, hd = t.shape
    t = norm(t.transpose(0, 2, 1, 3).reshape(B, L, H * hd))
    return t.reshape(B, L, H, hd).transpose(0, 2, 1, 3)


def _weightless(attn, layout, t):
    """llama4's inline QK-norm: ``mx.fast.rms_norm(t, None, eps)`` over head_dim (the same
    rows in head layout as before the transpose)."""
    eps = layout.inline_qk_norm_eps
    eps = getattr(attn, eps) if isinstance(eps, str) else eps
    return mx.fast.rms_norm(t, None, eps)


def _temperature(attn, q, offset):
    """llama4's attention temperature tuning on its NoPE layers: the queries at positions
    ``p = offset + 1 .. offset + L`` times ``1 + attn_scale * log(1 + floor(p / floor_scale))``
    (float32 factors, the product cast back to q's dtype, as mlx-lm's ``llama4.Attention``)."""
    L = q.shape[2]
    pos = mx.arange(offset + 1, offset + L + 1)
    scales = mx.log(mx.floor(pos / attn.floor_scale) + 1.0) * attn.attn_scale + 1.0
    return (q * scales[:, None]).astype(q.dtype)


def attend(attn, state: BricksState, choice, args, q, k, v, mask, cache, window=None,
           query_scale=None):
    """Q/K norms, RoPE, query scaling, KV-cache update and the attention piece, in the order
    the layout's mlx-lm forward applies them; q/k/v in head layout; ``args()`` builds the
    piece's arguments without q/k/v (called only for the brick); ``window``: the layer's
    sliding window (the stock path uses mlx-lm's ``mask`` as given); ``query_scale``: the
    ``attn_scale`` call argument of a ``query_scale="attn_scale"`` layout.

    Order: the module's q/k norms (per head, or over the full width) and llama4_text's
    weightless norm; RoPE with the module's own rope object at ``cache.offset`` (none on a
    NoPE layer: ``layout.rope_flag``); llama4's weightless norm after RoPE; ``q * attn_scale``
    (or llama4's temperature tuning on its NoPE layers);
    ``cache.update_and_fetch``; the attention.

    Returns (B, L, n_heads * head_dim), ready for the out-projection.
    """
    lay = state.layout
    B, _, L, _ = q.shape
    if lay.has_qk_norm(attn):
        q_norm, k_norm = (getattr(attn, n) for n in lay.qk_norm)
        if lay.qk_norm_width == "full":
            q, k = _full_width(q_norm, q), _full_width(k_norm, k)
        else:  # RMSNorm over head_dim: the same rows whether heads come before or after L
            q, k = q_norm(q), k_norm(k)
    inline = lay.inline_qk_norm is not None and bool(getattr(attn, lay.inline_qk_norm, False))
    if inline and not lay.inline_qk_norm_after_rope:
        q, k = _weightless(attn, lay, q), _weightless(attn, lay, k)
    # The module's own rope object with mlx-lm's offset keeps every rope class correct.
    if lay.has_rope(attn):
        if cache is not None:
            q = attn.rope(q, offset=cache.offset)
            k = attn.rope(k, offset=cache.offset)
        else:
            q = attn.rope(q)
            k = attn.rope(k)
    if inline and lay.inline_qk_norm_after_rope:
        q, k = _weightless(attn, lay, q), _weightless(attn, lay, k)
    if query_scale is not None:
        q = q * query_scale
    elif lay.query_scale == "llama4_temperature" and attn.attn_temperature_tuning and \
            not lay.has_rope(attn):
        q = _temperature(attn, q, cache.offset if cache is not None else 0)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
        if is_q8_cache(cache):  # k, v are (qs, d): only the Q8_0 readers take them
            from mlx_bricks.cache import q8_0_cache_attention

            state.calls["q8_0_cache_attention"] += 1
            o = q8_0_cache_attention(q, k, v, scale=state.layout.scale_of(attn), mask=mask,
                                     backend=cache.backend)
            return o.transpose(0, 2, 1, 3).reshape(B, L, -1)

    def stock():
        return attention_piece.attention_stock(attn, state.layout, q, k, v, mask, cache,
                                               kv_quant=state.kv_quant, window=window)

    o = run_piece(state, "attention", choice, attention_piece.KIND,
                  lambda: dict(args(), q=q, k=k, v=v), stock)
    return o.transpose(0, 2, 1, 3).reshape(B, L, -1)


class BricksAttention:
    """Attention with prefill on the GEMM and attention bricks (mixin over mlx-lm's Attention).

    Prefill pieces: ``q_proj``/``k_proj``/``v_proj`` (``linear``, biases kept), q/k norms,
    the module's rope at ``cache.offset`` and query scaling as the layout says (:func:`attend`),
    ``cache.update_and_fetch``, ``attention`` (``flash_attention``, causal, bottom-right aligned
    when the cache already holds tokens; the layer's window and the module's sinks where the
    layout has them), ``o_proj`` (``linear``). With the layout's ``output_gate`` (qwen3_next)
    ``q_proj`` gives each head's query then its gate, and ``o_proj`` reads
    ``attention * sigmoid(gate)``, as mlx-lm's ``Qwen3NextAttention``. Each linear piece and the
    attention piece run brick or stock (the module's own layer, mlx-lm's attention function)
    as the dispatcher decides, and where tuning applies the module is weighed whole against
    stock (``nn.runner.check_block``); all stock runs the original ``__call__``.
    Call signature as mlx-lm's: ``(x: (B, L, D), mask=None | "causal" | array, cache=None)``,
    or the layout's ``call_args`` (ministral3: ``(x, attn_scale, mask, cache)``).
    """

    def __call__(self, x, *args, **kwargs):
        state = self._bricks_state
        lay = state.layout
        values, rest, rest_kwargs = split_call(lay.call_args, args, kwargs)
        mask, cache = values.get("mask"), values.get("cache")
        stock, window, shape_key, q8 = admit(self, state, self, x, mask, cache, rest,
                                             rest_kwargs, values)
        if stock:
            return super().__call__(x, *args, **kwargs)
        B, L, _ = x.shape
        n_heads, n_kv_heads = lay.head_counts(self)
        qp, kp, vp, op = (self[n] for n in lay.attention_linears)
        lin = linear_piece.KIND

        def att_args():
            return attention_args(self, state, B, L, cache, x.dtype, mask, window)

        def pieces():
            o = Act((B, L, n_heads * state.head_dim), x.dtype)
            return {"q_proj": (lin, linear_piece.linear_args(qp, x)),
                    "k_proj": (lin, linear_piece.linear_args(kp, x)),
                    "v_proj": (lin, linear_piece.linear_args(vp, x)),
                    **({} if q8 else {"attention": (attention_piece.KIND, att_args())}),
                    "o_proj": (lin, linear_piece.linear_args(op, o))}

        # weighed whole against stock where tuning applies (nn.runner.check_block); a
        # row-sharded o_proj all-sums across ranks, so that module is not timed alone
        base = super(BricksAttention, self).__call__
        choices = check_block(state, shape_key, choose(state, shape_key, pieces), cache,
                              lambda c: self(x, *call_args(lay.call_args, values, c)),
                              lambda c: base(x, *call_args(lay.call_args, values, c)), L,
                              repeatable=not linear_piece.is_row_sharded(op))
        if all_stock(state, choices, shape_key):
            return super().__call__(x, *args, **kwargs)

        def proj(name, layer, n):
            y = run_piece(state, name, choices[name], lin,
                          lambda: linear_piece.linear_args(layer, x), lambda: layer(x))
            return heads(y, B, L, n)

        gate = None
        if lay.output_gate:  # per head: head_dim query columns, then head_dim gate columns
            y = run_piece(state, "q_proj", choices["q_proj"], lin,
                          lambda: linear_piece.linear_args(qp, x), lambda: qp(x))
            q, gate = mx.split(y.reshape(B, L, n_heads, -1), 2, axis=-1)
            q, gate = q.transpose(0, 2, 1, 3), gate.reshape(B, L, -1)
        else:
            q = proj("q_proj", qp, n_heads)
        k = proj("k_proj", kp, n_kv_heads)
        v = proj("v_proj", vp, n_kv_heads)
        o = attend(self, state, choices.get("attention"), att_args, q, k, v, mask, cache,
                   window, values.get("attn_scale"))
        if gate is not None:
            o = o * mx.sigmoid(gate)
        y = run_piece(state, "o_proj", choices["o_proj"], lin,
                      lambda: linear_piece.linear_args(op, o),
                      lambda: linear_piece.out_stock(op, o))
        return linear_piece.finish(op, y)
