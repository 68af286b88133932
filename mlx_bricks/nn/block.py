"""``BricksBlock``: the unified prefill block over a standard pre-norm mlx-lm decoder block."""
from __future__ import annotations

from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.norm_qkv import piece as qkv_piece
from mlx_bricks.bricks.swiglu import piece as mlp_piece
from mlx_bricks.bricks.attention import piece as attention_piece
from mlx_bricks.nn.attention import admit, attend, attention_args
from mlx_bricks.nn.calls import call_args, split_call
from mlx_bricks.nn.runner import all_stock, check_block, choose, run_piece
from mlx_bricks.runtime.kind import Act


class BricksBlock:
    """The unified prefill block (mixin over a standard pre-norm mlx-lm TransformerBlock).

    Prefill, for x (B, L, D), in four pieces::

        qkv:       q, k, v = rms_norm_qkv(x, input_norm, Wq, Wk, Wv)   # head layout (B, H, L, hd)
                   q, k    = q_norm(q), k_norm(k)          # as the layout says (attend)
                   q, k    = rope(q, k, offset=cache.offset); q = q * attn_scale (ministral3)
                   k, v    = cache.update_and_fetch(k, v)
        attention: o       = flash_attention(q, k, v, causal)
        o_proj:    h       = linear(o, Wo, residual=x)
        mlp:       out     = swiglu_mlp(rms_norm(h, post_attention_norm), W_gate, W_up, W_down,
                                        residual=h)

    Each piece runs its brick or the stock path as the dispatcher decides; the stock path of a
    piece is mlx-lm's: ``input_layernorm`` then ``q_proj``/``k_proj``/``v_proj``; mlx-lm's
    ``scaled_dot_product_attention``; ``x + o_proj(o)``; ``h + mlp(post_attention_layernorm(h))``.
    When every piece is stock the block's own ``__call__`` runs; where tuning applies, the
    pieces' bricks stand only if the whole block is faster than stock
    (``nn.runner.check_block``). Decode, array masks, caches other than ``KVCache`` and
    modules that are not plain ``nn.Linear`` / affine ``nn.QuantizedLinear`` / ``nn.RMSNorm``
    run the block's own ``__call__`` (counted with the reason). A quantized projection
    reaches its brick as a ``QuantizedWeight`` (packed weight, scales, biases, group_size,
    bits); q, k and v may each have their own format.
    Source: ``TransformerBlock``/``Attention``/``MLP`` of mlx-lm 0.32's ``models/llama.py``,
    ``qwen2.py``, ``qwen3.py``; the same math with the pieces fused into the bricks.
    """

    def __call__(self, x, *args, **kwargs):
        state = self._bricks_state
        lay = state.layout
        attn = self[lay.attention]
        values, rest, rest_kwargs = split_call(lay.call_args, args, kwargs)
        mask, cache = values.get("mask"), values.get("cache")
        stock, window, shape_key, q8 = admit(self, state, attn, x, mask, cache, rest,
                                             rest_kwargs, values)
        if stock:
            return super().__call__(x, *args, **kwargs)

        B, L, D = x.shape
        mlp = self[lay.mlp]
        op = attn[lay.o_proj]
        post = self[lay.post_attention_norm]
        lin = linear_piece.KIND

        def qkv_args():
            return qkv_piece.qkv_args(self, lay, x, state.head_dim)

        def att_args():
            return attention_args(attn, state, B, L, cache, x.dtype, mask, window)

        def pieces():
            h = Act((B, L, D), x.dtype)
            o = Act((B, L, lay.head_counts(attn)[0] * state.head_dim), x.dtype)
            return {"qkv": (qkv_piece.KIND, qkv_args()),
                    **({} if q8 else {"attention": (attention_piece.KIND, att_args())}),
                    "o_proj": (lin, linear_piece.linear_args(op, o, residual=x)),
                    "mlp": (mlp_piece.MLP_PIECE.kind, mlp_piece.mlp_args(mlp, lay, h, h))}

        # a row-sharded block all-sums across ranks: timing it alone per rank could run
        # different numbers of collectives on the ranks, so it is not weighed whole
        sharded = linear_piece.is_row_sharded(op) or linear_piece.is_row_sharded(
            mlp[lay.down_proj])
        base = super(BricksBlock, self).__call__
        choices = check_block(state, shape_key, choose(state, shape_key, pieces),
                              cache, lambda c: self(x, *call_args(lay.call_args, values, c)),
                              lambda c: base(x, *call_args(lay.call_args, values, c)), L,
                              repeatable=not sharded)
        if all_stock(state, choices, shape_key):
            return super().__call__(x, *args, **kwargs)

        q, k, v = run_piece(state, "qkv", choices["qkv"], qkv_piece.KIND, qkv_args,
                            lambda: qkv_piece.qkv_stock(self, lay, x))
        o = attend(attn, state, choices.get("attention"), att_args, q, k, v, mask, cache,
                   window, values.get("attn_scale"))
        # A row-sharded o/down: the piece gives the local partial product; finish all-sums
        # it, adds the bias, then the residual once (as the stock layer and block do).
        h = linear_piece.finish(op, run_piece(state, "o_proj", choices["o_proj"], lin,
                                              lambda: linear_piece.linear_args(op, o, residual=x),
                                              lambda: linear_piece.out_stock(op, o, x)), x)
        hn = post(h)  # nn.RMSNorm: mx.fast.rms_norm(h, weight, eps), as the brick path needs
        y = run_piece(state, "mlp", choices["mlp"], mlp_piece.MLP_PIECE.kind,
                      lambda: mlp_piece.mlp_args(mlp, lay, hn, h),
                      lambda: mlp_piece.mlp_stock(mlp, lay, hn, h))
        return linear_piece.finish(mlp[lay.down_proj], y, h)
