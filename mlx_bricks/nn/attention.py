"""``BricksAttention``: an mlx-lm attention module with its prefill on the GEMM and attention
bricks, and what the attention and block mixins share (call admission, the attention step)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.attention import piece as attention_piece
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.norm_qkv.piece import heads
from mlx_bricks.nn.calls import cache_offset, call_reason, is_q8_cache, layer_window, mask_key
from mlx_bricks.nn.runner import (BricksState, all_stock, check_block, choose, run_piece,
                                  stock_fast)
from mlx_bricks.nn.structure import structure_reason
from mlx_bricks.runtime.kind import Act


def admit(module, state: BricksState, attn, x, mask, cache, args, kwargs, keys=None):
    """The call checks shared by the attention and block mixins (``attn``: the attention
    module, ``module`` itself for the attention mixin).

    ``keys``: the key count where the keys do not come from ``cache`` (gemma4's shared K/V;
    part of the call shape then). Returns ``(stock, window, shape_key, q8)``: ``stock`` True
    when the call runs the module's own code, either counted with its reason here or through
    the all-stock fast path (``runner.stock_fast``); otherwise the layer's sliding window,
    the call-shape key of the dispatcher's memos and whether the cache is a ``Q8KVCache``
    (whose attention is the Q8_0 readers, untuned).
    """
    window, reason = layer_window(attn, state.layout, state.layer)
    reason = reason or call_reason(x, mask, cache, args, kwargs, window,
                                   state.layout.causal_array, keys)
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


def attention_args(attn, state: BricksState, B, L, cache, dtype, mask, window):
    """The attention piece's arguments (shapes only) for this module and call."""
    return attention_piece.attention_args(attn, state.layout, B, L, cache, dtype, mask,
                                          head_dim=state.head_dim, kv_quant=state.kv_quant,
                                          window=window)


def attend(attn, state: BricksState, choice, args, q, k, v, mask, cache, window=None):
    """Per-head norms, RoPE, KV-cache update and the attention piece; q/k/v in head layout;
    ``args()`` builds the piece's arguments without q/k/v (called only for the brick);
    ``window``: the layer's sliding window (the stock path uses mlx-lm's ``mask`` as given).

    Returns (B, L, n_heads * head_dim), ready for the out-projection.
    """
    B, _, L, _ = q.shape
    if state.layout.qk_norm is not None:
        # RMSNorm over head_dim: the same rows whether heads come before or after L.
        q_norm, k_norm = (getattr(attn, n) for n in state.layout.qk_norm)
        q, k = q_norm(q), k_norm(k)
    # The module's own rope object with mlx-lm's offset keeps every rope class correct.
    if cache is not None:
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if is_q8_cache(cache):  # k, v are (qs, d): only the Q8_0 readers take them
            from mlx_bricks.cache import q8_0_cache_attention

            state.calls["q8_0_cache_attention"] += 1
            o = q8_0_cache_attention(q, k, v, scale=state.layout.scale_of(attn), mask=mask,
                                     backend=cache.backend)
            return o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    else:
        q = attn.rope(q)
        k = attn.rope(k)

    def stock():
        return attention_piece.attention_stock(attn, state.layout, q, k, v, mask, cache,
                                               kv_quant=state.kv_quant, window=window)

    o = run_piece(state, "attention", choice, attention_piece.KIND,
                  lambda: dict(args(), q=q, k=k, v=v), stock)
    return o.transpose(0, 2, 1, 3).reshape(B, L, -1)


class BricksAttention:
    """Attention with prefill on the GEMM and attention bricks (mixin over mlx-lm's Attention).

    Prefill pieces: ``q_proj``/``k_proj``/``v_proj`` (``linear``, biases kept), per-head q/k
    RMSNorm when the layout has it, the module's rope at ``cache.offset``,
    ``cache.update_and_fetch``, ``attention`` (``flash_attention``, causal, bottom-right aligned
    when the cache already holds tokens; the layer's window and the module's sinks where the
    layout has them), ``o_proj`` (``linear``). With the layout's ``output_gate`` (qwen3_next)
    ``q_proj`` gives each head's query then its gate, and ``o_proj`` reads
    ``attention * sigmoid(gate)``, as mlx-lm's ``Qwen3NextAttention``. Each linear piece and the
    attention piece run brick or stock (the module's own layer, mlx-lm's attention function)
    as the dispatcher decides, and where tuning applies the module is weighed whole against
    stock (``nn.runner.check_block``); all stock runs the original ``__call__``.
    Call signature as mlx-lm's: ``(x: (B, L, D), mask=None | "causal" | array, cache=None)``.
    """

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        state = self._bricks_state
        lay = state.layout
        stock, window, shape_key, q8 = admit(self, state, self, x, mask, cache, args, kwargs)
        if stock:
            return super().__call__(x, mask, cache, *args, **kwargs)
        B, L, _ = x.shape
        qp, kp, vp, op = (self[n] for n in lay.attention_linears)
        n_heads, n_kv = lay.n_heads(self), lay.n_kv_heads(self)
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
        choices = check_block(state, shape_key, choose(state, shape_key, pieces), cache,
                              lambda c: self(x, mask, c),
                              lambda c: super(BricksAttention, self).__call__(x, mask, c), L,
                              repeatable=not linear_piece.is_row_sharded(op))
        if all_stock(state, choices, shape_key):
            return super().__call__(x, mask, cache)

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
        k = proj("k_proj", kp, n_kv)
        v = proj("v_proj", vp, n_kv)
        o = attend(self, state, choices.get("attention"), att_args, q, k, v, mask, cache,
                   window)
        if gate is not None:
            o = o * mx.sigmoid(gate)
        y = run_piece(state, "o_proj", choices["o_proj"], lin,
                      lambda: linear_piece.linear_args(op, o),
                      lambda: linear_piece.out_stock(op, o))
        return linear_piece.finish(op, y)
