"""``BricksSharedKVAttention``: gemma4's attention module (mlx-lm 0.32's
``gemma4_text.Attention``) with its prefill on the GEMM and attention bricks.

That module is called ``(x, mask, cache, shared_kv=None, offset=None)`` and returns
``(out, (keys, values), offset)``: the keys and values it attended over (after the cache) and
the RoPE offset, which the model hands to the layers that share them (``num_kv_shared_layers``:
a layer whose ``has_kv`` is False has no k/v projections and attends over an earlier layer's).
Global layers may take values equal to the raw key projection (``use_k_eq_v``, no
``v_proj``); values go through a weightless RMSNorm (``v_norm``); the scale is 1.0 (q and k
are RMS-normalised). The bricks replace the projections and the attention; every other step
is the module's own, in the module's order, so the returned keys, values and offset are the
ones stock returns.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.attention import piece as attention_piece
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.nn.attention import admit, attention_args
from mlx_bricks.nn.runner import all_stock, check_block, choose, run_piece
from mlx_bricks.runtime.kind import Act


class BricksSharedKVAttention:
    """gemma4's attention with prefill on the bricks (mixin over ``gemma4_text.Attention``;
    module docstring).

    Prefill pieces: ``q_proj`` (``linear``), the module's ``q_norm``; where the layer owns its
    K/V, ``k_proj`` (and ``v_proj`` unless ``use_k_eq_v``: values are then the raw key
    projection), ``k_norm`` and the module's rope on the keys at ``mx.array(cache.offset)``,
    ``v_norm`` on the values; otherwise the ``shared_kv`` keys/values and ``offset`` it is
    given. Then the rope on the queries, ``cache.update_and_fetch``, ``attention``
    (``flash_attention``: causal bottom-right over the keys it has, the layer's window on
    sliding layers, the module's scale), ``o_proj`` (``linear``). Returns
    ``(out, (keys, values), offset)`` as the module does. Calls the bricks do not cover
    (decode, other masks or caches, extra arguments) run the module's own ``__call__``, counted
    with the reason.
    """

    def __call__(self, x, mask=None, cache=None, *args, shared_kv=None, offset=None,
                 **kwargs):
        state = self._bricks_state
        lay = state.layout
        base = super(BricksSharedKVAttention, self).__call__

        def stock(c=cache):
            return base(x, mask, c, *args, shared_kv=shared_kv, offset=offset, **kwargs)

        own = shared_kv is None
        if not own and cache is not None:
            # mlx-lm hands a shared layer no cache; with one, the two would disagree
            state.stock["shared_kv and a cache both given: not mlx-lm's call"] += 1
            return stock()
        if own and not lay.owns_kv(self):
            return stock()  # stock raises mlx-lm's own error (a shared layer without shared_kv)
        Lk = None if own else shared_kv[0].shape[2]
        skip, window, shape_key, q8 = admit(self, state, self, x, mask, cache, args, kwargs,
                                            keys=Lk)
        if skip:
            return stock()
        if q8:
            state.stock["Q8_0 cache: its readers take gemma4's shared K/V unpatched"] += 1
            return stock()
        B, L, _ = x.shape
        hd = state.head_dim
        n_heads, n_kv = lay.head_counts(self)
        names = lay.attention_linears_of(self)
        lin = linear_piece.KIND

        def att_args():
            a = attention_args(self, state, B, L, cache, x.dtype, mask, window)
            if not own:  # keys: the shared ones, whatever the (absent) cache would say
                a["k"] = a["v"] = Act((B, n_kv, Lk, hd), x.dtype)
            return a

        def pieces():
            o = Act((B, L, n_heads * hd), x.dtype)
            out = {n: (lin, linear_piece.linear_args(self[n], x)) for n in names
                   if n != lay.o_proj}
            out["attention"] = (attention_piece.KIND, att_args())
            out[lay.o_proj] = (lin, linear_piece.linear_args(self[lay.o_proj], o))
            return out

        op = self[lay.o_proj]
        choices = check_block(state, shape_key, choose(state, shape_key, pieces), cache,
                              lambda c: self(x, mask, c, shared_kv=shared_kv, offset=offset),
                              lambda c: base(x, mask, c, shared_kv=shared_kv, offset=offset),
                              L, repeatable=not linear_piece.is_row_sharded(op))
        if all_stock(state, choices, shape_key):
            return stock()

        def proj(name, n):
            layer = self[name]
            y = run_piece(state, name, choices[name], lin,
                          lambda: linear_piece.linear_args(layer, x), lambda: layer(x))
            return y.reshape(B, L, n, hd)

        q_norm = self[lay.qk_norm[0]] if lay.qk_norm else None
        queries = proj(lay.q_proj, n_heads)
        if q_norm is not None:
            queries = q_norm(queries)
        if own:
            keys = proj(lay.k_proj, n_kv)
            values = keys if lay.v_proj not in names else proj(lay.v_proj, n_kv)
            offset = mx.array(cache.offset) if cache is not None else 0
            if lay.qk_norm:
                keys = self[lay.qk_norm[1]](keys)
            keys = self.rope(keys.transpose(0, 2, 1, 3), offset=offset)
            values = self[lay.v_norm](values).transpose(0, 2, 1, 3)
        else:
            keys, values = shared_kv
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        def attention_stock():
            return attention_piece.attention_stock(self, lay, queries, keys, values, mask,
                                                   cache, kv_quant=state.kv_quant,
                                                   window=window)

        o = run_piece(state, "attention", choices["attention"], attention_piece.KIND,
                      lambda: dict(att_args(), q=queries, k=keys, v=values), attention_stock)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        y = run_piece(state, lay.o_proj, choices[lay.o_proj], lin,
                      lambda: linear_piece.linear_args(op, o),
                      lambda: linear_piece.out_stock(op, o))
        return linear_piece.finish(op, y), (keys, values), offset
