"""``BricksPiece``: the generic single-piece module. A module whose whole prefill is one brick
piece (an MLP; a MoE MLP is one more piece) is switched to it with the piece that describes
it (``BricksState.piece``: ``bricks.swiglu.piece.MLP_PIECE``, ``bricks.moe.piece.MOE_PIECE``),
which gives the op kind, the call signature check, the structure check, the arguments, the stock
path and the finish.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.runner import all_stock, choose, run_piece, stock_fast
from mlx_bricks.nn.structure import structure_reason


def _input_reason(x) -> str | None:
    if not isinstance(x, mx.array) or x.ndim < 2:
        return "input is not a (..., L, D) array"
    if x.shape[-2] == 1:
        return DECODE
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(x.dtype)} is not float16/bfloat16/float32"
    return None


def _shape_key(x, args) -> tuple:
    """The call shape the dispatch's choices are remembered under: x's shape and dtype and the
    shapes of the extra array arguments a piece takes (``SwitchGLU``'s indices)."""
    return (x.shape, x.dtype, tuple(getattr(a, "shape", None) for a in args))


class BricksPiece:
    """A module whose prefill is one piece (mixin over its own class; module docstring).

    Prefill (``x`` of shape (..., L, D), L > 1): the piece's brick or the module's original
    ``__call__``, as the dispatcher decides; decode and calls the piece does not cover run the
    original ``__call__``, counted with the reason. Extra call arguments the piece accepts
    (``piece.call_reason`` None: ``SwitchGLU``'s ``indices``) are handed to ``piece.args`` and
    ``piece.stock`` after ``x``, and to the original ``__call__`` as they came.
    """

    def __call__(self, x, *args, **kwargs):
        state = self._bricks_state
        piece = state.piece
        reason = piece.call_reason(args, kwargs) or _input_reason(x)
        shape_key = _shape_key(x, args) if reason is None else None
        if reason is None:
            if stock_fast(state, shape_key):
                return super().__call__(x, *args)
            reason = structure_reason(self, state, x.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(x, *args, **kwargs)
        lay = state.layout
        choices = choose(state, shape_key,
                         lambda: {piece.role: (piece.kind, piece.args(self, lay, x, *args))})
        if all_stock(state, choices, shape_key):
            return super().__call__(x, *args)
        call = super(BricksPiece, self).__call__
        y = run_piece(state, piece.role, choices[piece.role], piece.kind,
                      lambda: piece.args(self, lay, x, *args),
                      lambda: piece.stock(self, lay, x, *args, call=call))
        return piece.finish(self, lay, y)
