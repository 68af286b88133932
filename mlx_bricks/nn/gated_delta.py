"""``BricksGatedDelta``: an mlx-lm Gated DeltaNet mixer (``bricks.gated_delta.piece``) with its
prefill recurrence on the Gated DeltaNet brick. Decode (one token) runs the module's own
``__call__`` (mlx-lm's kernel or step) after a single length check."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.gated_delta.piece import cache_reason, epilogue, prologue
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.runner import all_stock, choose, run_piece, stock_fast
from mlx_bricks.nn.structure import structure_reason


class BricksGatedDelta:
    """A Gated DeltaNet mixer whose prefill (L > 1) recurrence is the brick's or stock's, as
    the dispatcher decides; the projections, conv, norms and the cache writes are the module's
    own code (``piece.prologue`` / ``piece.epilogue``). Decode, calls with other arguments,
    other caches and unknown structure run the original ``__call__``, counted with the
    reason."""

    def __call__(self, inputs, mask=None, cache=None, *args, **kwargs):
        if inputs.shape[1] == 1:  # decode first: stock's own step, nothing else
            self._bricks_state.stock[DECODE] += 1
            return super().__call__(inputs, mask, cache, *args, **kwargs)
        state = self._bricks_state
        piece = state.piece
        reason = None
        if args or kwargs:
            reason = f"call arguments other than (inputs, mask, cache): {sorted(kwargs)}"
        elif not isinstance(inputs, mx.array) or inputs.ndim != 3:
            reason = "input is not a (B, L, D) array"
        elif mask is not None and (not isinstance(mask, mx.array) or mask.dtype != mx.bool_
                                   or tuple(mask.shape) != tuple(inputs.shape[:2])):
            reason = "mask is not a (B, L) bool array"
        else:
            reason = cache_reason(cache)
        shape_key = None
        if reason is None:
            shape_key = (inputs.shape, inputs.dtype, mask is not None, cache is None)
            if stock_fast(state, shape_key):
                return super().__call__(inputs, mask, cache)
            reason = structure_reason(self, state, inputs.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(inputs, mask, cache, *args, **kwargs)
        kind = piece.kind
        choices = choose(state, shape_key, lambda: {
            piece.role: (kind, piece.placeholders(self, inputs, mask))})
        if all_stock(state, choices, shape_key):
            return super().__call__(inputs, mask, cache)
        args_, z = prologue(self, inputs, mask, cache)
        y, new_state = run_piece(state, piece.role, choices[piece.role], kind,
                                 lambda: args_, lambda: kind.stock(args_))
        return epilogue(self, y, new_state, z, cache, inputs.shape[1])
