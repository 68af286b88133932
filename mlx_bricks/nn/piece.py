"""``BricksPiece``: the generic single-piece module. A module whose whole prefill is one brick
piece (an MLP; a MoE MLP is one more piece) is switched to it with the piece that describes
it (``BricksState.piece``: e.g. ``bricks.swiglu.piece.MLP_PIECE``), which gives the op kind,
the call signature check, the structure check, the arguments, the stock path and the finish.
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


class BricksPiece:
    """A module whose prefill is one piece (mixin over its own class; module docstring).

    Prefill (``x`` of shape (..., L, D), L > 1): the piece's brick or the module's original
    ``__call__``, as the dispatcher decides; decode and calls the piece does not cover run the
    original ``__call__``, counted with the reason.
    """

    def __call__(self, x, *args, **kwargs):
        state = self._bricks_state
        piece = state.piece
        reason = piece.call_reason(args, kwargs) or _input_reason(x)
        shape_key = (x.shape, x.dtype) if reason is None else None
        if reason is None:
            if stock_fast(state, shape_key):
                return super().__call__(x)
            reason = structure_reason(self, state, x.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(x, *args, **kwargs)
        lay = state.layout
        choices = choose(state, shape_key,
                         lambda: {piece.role: (piece.kind, piece.args(self, lay, x))})
        if all_stock(state, choices, shape_key):
            return super().__call__(x)
        y = run_piece(state, piece.role, choices[piece.role], piece.kind,
                      lambda: piece.args(self, lay, x),
                      lambda: piece.stock(self, lay, x, call=super(BricksPiece, self).__call__))
        return piece.finish(self, lay, y)
