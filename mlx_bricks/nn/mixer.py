"""``BricksMixer``: an mlx-lm token-mixer module (Gated DeltaNet, Mamba-2, short convolution,
MLA, ...) whose prefill runs one brick piece, the mixer's own projections and cache writes
around it.

The piece (``piece`` of the module's :class:`~mlx_bricks.nn.runner.BricksState`, one object per
mixer kind in ``mlx_bricks/bricks/<brick>/piece.py``, listed in ``patch/mixers.py``) says how:

* ``call_names``: the names of the module's ``__call__`` arguments after the input (e.g.
  ``("mask", "cache")``); a call with other arguments runs stock;
* ``call_reason(module, inputs, call) -> str | None``: why this call's arguments (a dict of
  ``call_names``) are not ones the piece follows (a mask or cache type it does not write);
* ``shape_key(module, inputs, call)``: what the dispatcher's choice depends on;
* ``placeholders(module, inputs, call) -> dict``: the kind's arguments as shapes (``Act``);
* ``prologue(module, inputs, call) -> (args, ctx)``: the module's own code up to the brick;
* ``epilogue(module, out, ctx, inputs, call)``: the module's own code after it (cache writes,
  norms, out-projection); returns the module's output;
* ``kind``, ``role``, ``bricks``, ``watched``, ``linears()``, ``reason()`` as for every piece.

Decode (one token) runs the module's own ``__call__`` after a single length check (and the
model's decode gate normally switches the class away before that: ``nn.gate``).
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.runner import all_stock, choose, run_piece, stock_fast
from mlx_bricks.nn.structure import structure_reason


def bind_call(names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[dict, str | None]:
    """``{name: value}`` of a call's arguments after the input, by ``names`` (missing ones
    None), and why the call cannot be followed (more positional arguments than ``names``, or
    a keyword not among them), else None."""
    if len(args) > len(names):
        return {}, f"{len(args)} positional call arguments, expected at most {len(names)}"
    extra = sorted(set(kwargs) - set(names[len(args):]))
    if extra:
        return {}, f"call arguments other than {names}: {extra}"
    call = dict(zip(names, args))
    call.update(kwargs)
    return {n: call.get(n) for n in names}, None


class BricksMixer:
    """A token-mixer module whose prefill (L > 1) runs its piece's brick or stock, as the
    dispatcher decides (module docstring). Decode, calls with other arguments, caches the
    piece does not write and unknown structure run the original ``__call__``, counted with
    the reason."""

    def __call__(self, inputs, *args, **kwargs):
        if getattr(inputs, "ndim", 0) == 3 and inputs.shape[1] == 1:  # decode: stock's step
            self._bricks_state.stock[DECODE] += 1
            return super().__call__(inputs, *args, **kwargs)
        state = self._bricks_state
        piece = state.piece
        call, reason = bind_call(piece.call_names, args, kwargs)
        if reason is None:
            if not isinstance(inputs, mx.array) or inputs.ndim != 3:
                reason = "input is not a (B, L, D) array"
            else:
                reason = piece.call_reason(self, inputs, call)
        shape_key = None
        if reason is None:
            shape_key = piece.shape_key(self, inputs, call)
            if stock_fast(state, shape_key):
                return super().__call__(inputs, *args, **kwargs)
            reason = structure_reason(self, state, inputs.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(inputs, *args, **kwargs)
        kind = piece.kind
        choices = choose(state, shape_key, lambda: {
            piece.role: (kind, piece.placeholders(self, inputs, call))})
        if all_stock(state, choices, shape_key):
            return super().__call__(inputs, *args, **kwargs)
        op_args, ctx = piece.prologue(self, inputs, call)
        out = run_piece(state, piece.role, choices[piece.role], kind,
                        lambda: op_args, lambda: kind.stock(op_args))
        return piece.epilogue(self, out, ctx, inputs, call)
