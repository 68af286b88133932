"""``BricksMixer``: an mlx-lm token-mixer module (Gated DeltaNet, Mamba-2, short convolution,
MLA, ...) whose prefill runs one brick piece, the mixer's own projections and cache writes
around it.

The piece (``piece`` of the module's :class:`~mlx_bricks.nn.runner.BricksState`, one object per
mixer kind in ``mlx_bricks/bricks/<brick>/piece.py``, listed in ``patch/modules.py``) says how:

* ``call_names``: the names of the module's ``__call__`` arguments after the input (e.g.
  ``("mask", "cache")``); a call with other arguments runs stock; optionally ``input_name``,
  the input's parameter name, for callers that pass it by keyword;
* ``call_reason(module, inputs, call) -> str | None``: why this call's arguments (a dict of
  ``call_names``) are not ones the piece follows (a mask or cache type it does not write);
* ``shape_key(module, inputs, call)``: what the dispatcher's choice depends on;
* ``placeholders(module, inputs, call) -> dict``: the kind's arguments as shapes (``Act``);
* ``prologue(module, inputs, call) -> (args, ctx)``: the module's own code up to the brick;
* optionally ``stages(module, inputs, call) -> {role: (kind, placeholders)}``: other pieces
  the prologue runs (a Mamba-2 mixer's conv before its scan), each tuned like the main one;
  the prologue then gets a fourth argument ``run(role, kind, args)`` that runs one (brick or
  stock, as chosen);
* ``epilogue(module, out, ctx, inputs, call)``: the module's own code after it (cache writes,
  norms, out-projection); returns the module's output;
* ``kind``, ``role``, ``bricks``, ``watched``, ``linears()``, ``reason()`` as for every piece.

A mixer of several pieces (multi-head latent attention: its projections on the GEMM brick, its
core on the attention brick) gives instead of ``placeholders`` / ``prologue`` / ``epilogue``:

* ``pieces(module, inputs, call) -> {name: (kind, args)}``: every piece this call shape runs
  (arguments as shapes), chosen together and remembered under ``shape_key``;
* ``forward(module, inputs, call, run) -> output``: the module's computation, each piece
  through ``run(name, kind, args, stock)`` (``args()`` builds the brick's arguments,
  ``stock()`` is the module's own code for it; ``nn.runner.run_piece``).

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


def split_input(name: str | None, args: tuple, kwargs: dict) -> tuple:
    """``(input, other positional arguments, other keyword arguments)`` of a call: the input
    is the first positional argument, else the keyword ``name`` (the piece's ``input_name``:
    plamo2 and falcon_h1 layers call their mixers by keywords)."""
    if args:
        return args[0], args[1:], kwargs
    named = dict(kwargs)
    return named.pop(name, None), (), named


class BricksMixer:
    """A token-mixer module whose prefill (L > 1) runs its piece's brick or stock, as the
    dispatcher decides (module docstring). Decode, calls with other arguments, caches the
    piece does not write and unknown structure run the original ``__call__``, counted with
    the reason."""

    def __call__(self, *args, **kwargs):
        state = self._bricks_state
        piece = state.piece
        inputs, rest, named = split_input(getattr(piece, "input_name", None), args, kwargs)
        if getattr(inputs, "ndim", 0) == 3 and inputs.shape[1] == 1:  # decode: stock's step
            state.stock[DECODE] += 1
            return super().__call__(*args, **kwargs)
        call, reason = bind_call(piece.call_names, rest, named)
        if reason is None:
            if not isinstance(inputs, mx.array) or inputs.ndim != 3:
                reason = "input is not a (B, L, D) array"
            else:
                reason = piece.call_reason(self, inputs, call)
        shape_key = None
        if reason is None:
            shape_key = piece.shape_key(self, inputs, call)
            if stock_fast(state, shape_key):
                return super().__call__(*args, **kwargs)
            reason = structure_reason(self, state, inputs.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(*args, **kwargs)
        kind = piece.kind
        several = getattr(piece, "pieces", None)
        stages = getattr(piece, "stages", None)
        choices = choose(state, shape_key, lambda: several(self, inputs, call) if several else {
            **(stages(self, inputs, call) if stages else {}),
            piece.role: (kind, piece.placeholders(self, inputs, call))})
        if all_stock(state, choices, shape_key):
            return super().__call__(*args, **kwargs)
        if several is not None:  # the piece's forward runs every piece itself
            return piece.forward(self, inputs, call, lambda name, k, a, stock: run_piece(
                state, name, choices[name], k, a, stock))

        def run(role, stage_kind, stage_args):  # a stage of the prologue, brick or stock
            return run_piece(state, role, choices[role], stage_kind, lambda: stage_args,
                             lambda: stage_kind.stock(stage_args))

        op_args, ctx = (piece.prologue(self, inputs, call, run) if stages
                        else piece.prologue(self, inputs, call))
        out = run(piece.role, kind, op_args)
        return piece.epilogue(self, out, ctx, inputs, call)
