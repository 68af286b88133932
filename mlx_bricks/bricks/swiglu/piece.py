"""The SwiGLU brick's piece in a patched mlx-lm module: an MLP (``gate_proj``, ``up_proj``,
``down_proj`` and the layout's activation) as one ``swiglu_mlp`` piece, with its arguments,
its stock path and its structure check.

:data:`MLP_PIECE` is what the generic single-piece module (``mlx_bricks.nn.piece``) runs for
an MLP module on its own; the unified block uses the same functions for its MLP piece.
"""
from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from mlx_bricks.bricks.gemm.piece import finish
from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP
from mlx_bricks.formats.layers import (
    bias_of,
    is_row_sharded,
    linear_reason,
    partial_product,
    role_reason,
    weight_of,
)


def mlp_args(mlp, layout, x, residual=None) -> dict:
    """The MLP piece's arguments from the module's layers (``layout``: the architecture's
    ``BlockLayout``). With a row-sharded down projection the brick computes the local partial
    product only: ``b_down`` and the residual come after the ``all_sum``."""
    gate, up, down = (getattr(mlp, n) for n in layout.mlp_linears)
    if is_row_sharded(down):
        b_down, residual = None, None
    else:
        b_down = bias_of(down)
    args = {"x": x, "w_gate": weight_of(gate), "w_up": weight_of(up), "w_down": weight_of(down),
            "b_gate": bias_of(gate), "b_up": bias_of(up), "b_down": b_down,
            "residual": residual}
    if layout.activation != "silu":  # SiLU MLPs keep their arguments (and tuning keys)
        args["activation"] = layout.activation
    return args


def mlp_stock(mlp, layout, x, residual=None, call=None):
    """The stock path of the MLP piece: mlx-lm's ``residual + mlp(x)`` (``call``: the MLP's
    stock ``__call__``, default ``mlp`` itself); with a row-sharded down projection, mlx-lm's
    ``swiglu(gate_proj(x), up_proj(x))`` (``gelu_approx(gate) * up`` for the layout's
    ``gelu_tanh``, as mlx-lm's gemma MLPs) times the local down shard, before the ``all_sum``
    (``gemm.piece.finish``)."""
    down = getattr(mlp, layout.down_proj)
    if is_row_sharded(down):
        g, u = getattr(mlp, layout.gate_proj)(x), getattr(mlp, layout.up_proj)(x)
        act = nn.gelu_approx(g) * u if layout.activation == "gelu_tanh" else swiglu(g, u)
        return partial_product(down, act)
    y = (call or mlp)(x)
    return y if residual is None else residual + y


def sharding_reason(mlp, layout) -> str | None:
    """Why the MLP's tensor-parallel sharding is not mlx-lm's (None: plain, or gate/up
    column-sharded and down row-sharded)."""
    return role_reason((layout.gate_proj, layout.up_proj), (layout.down_proj,), mlp)


def mlp_reason(mlp, layout, dtype=None) -> str | None:
    """Why the MLP module cannot run the brick for inputs of ``dtype`` (None: it can)."""
    for n in layout.mlp_linears:
        r = linear_reason(n, getattr(mlp, n, None), dtype)
        if r is not None:
            return r
    return sharding_reason(mlp, layout)


class MLPPiece:
    """An mlx-lm MLP module as one piece (what ``mlx_bricks.nn.piece.BricksPiece`` runs).

    Attributes:
        role: the module's role in reports (``"mlp"``).
        kind: the op kind (``swiglu_mlp``).
        bricks: the brick ops the module runs in prefill (for the report).
    """

    role = "mlp"
    kind = SWIGLU_MLP
    bricks = (SWIGLU_MLP.op_name,)

    def linears(self, layout) -> tuple[str, ...]:
        """The linear layers the piece reads (structure fingerprint, weight formats)."""
        return layout.mlp_linears

    def call_reason(self, args, kwargs) -> str | None:
        """Why a call with these extra arguments (besides ``x``) is not the MLP's: mlx-lm's
        MLP takes ``x`` only."""
        if args or kwargs:
            return f"extra call arguments ({len(args)} positional, {sorted(kwargs)}): stock"
        return None

    def reason(self, module, layout, dtype=None) -> str | None:
        return mlp_reason(module, layout, dtype)

    def args(self, module, layout, x) -> dict:
        return mlp_args(module, layout, x)

    def stock(self, module, layout, x, call):
        return mlp_stock(module, layout, x, call=call)

    def finish(self, module, layout, y):
        return finish(getattr(module, layout.down_proj), y)


MLP_PIECE = MLPPiece()
