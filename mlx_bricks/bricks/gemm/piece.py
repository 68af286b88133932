"""The GEMM brick's pieces in a patched mlx-lm module: a linear layer's arguments for the
``linear`` kind, its stock path, and the finish of a row-sharded output projection.

A piece is what a patched module hands the dispatch for one part of its prefill: the op kind,
the arguments (built from the module's own layers), and the stock computation (the layer
itself). Tensor-parallel layers (``formats.layers``): for a row-sharded o/down the piece
computes the local partial product (no bias, no residual), then :func:`finish` applies the
layer's ``all_sum``, its bias and the residual once.
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.bricks.gemm.kind import LINEAR
from mlx_bricks.formats.layers import (
    QUANTIZED_SHARDED,
    bias_of,
    is_row_sharded,
    partial_product,
    reduce_partial,
    weight_of,
)

#: The op kind of a linear piece.
KIND = LINEAR


def linear_args(linear, x, residual=None) -> dict:
    """The ``linear`` piece's arguments. For a row-sharded layer the brick computes the local
    partial product only: bias and residual come after the ``all_sum`` (:func:`finish`)."""
    if is_row_sharded(linear):
        return {"x": x, "weight": weight_of(linear), "bias": None, "residual": None}
    return {"x": x, "weight": weight_of(linear), "bias": bias_of(linear), "residual": residual}


def out_stock(linear, x, residual=None):
    """The stock path of an output-projection piece: mlx-lm's ``residual + linear(x)``; for a
    row-sharded layer the piece's value is the local partial product (:func:`finish` reduces
    it)."""
    if is_row_sharded(linear):
        return partial_product(linear, x)
    y = linear(x)
    return y if residual is None else residual + y


def finish(linear, y, residual=None):
    """The output of an output projection (o, down) from its piece's output ``y``: for a
    row-sharded layer ``y`` is this rank's partial product, reduced as the stock layer does
    (``all_sum``, bias, then the residual once); otherwise ``y`` is already complete."""
    return reduce_partial(linear, y, residual) if is_row_sharded(linear) else y


def stage_names(module, names, dtype) -> tuple[str, ...]:
    """Of the linear layers ``names`` of a mixer ``module``, those that run as ``linear``
    stages: the ones the GEMM brick reads (``formats.layers.linear_reason``; ``dtype`` the
    activations', None when unknown), not row-sharded (a tensor-parallel layer whose output
    is an ``all_sum`` of partial products: the layer itself reduces it), and whose weight the
    module's dispatch admits (``Dispatch.admits``: without a kernel backend, quantized ones
    and bfloat16 ones on the CPU); any other runs the module's own layer."""
    from mlx_bricks.formats.layers import linear_reason

    dispatch = getattr(module.__dict__.get("_bricks_state"), "dispatch", None)
    names = tuple(names)
    # What the answer depends on, compared by identity: the layers, their weights (a
    # quantized layer's view is itself kept while its arrays are: formats.layers.weight_of),
    # their biases and the dispatch. Kept in the module's __dict__ (asked once per call).
    layers = tuple(module.get(n) for n in names)
    deps = (dispatch,) + tuple(x for m in layers for x in (
        (m, type(m), _weight_dep(m), m.get("bias")) if isinstance(m, nn.Module) else (m,)))
    memo = module.__dict__.setdefault(STAGES_MEMO, {})
    hit = memo.get((names, dtype))
    if hit is not None and len(hit[0]) == len(deps) and all(
            a is b for a, b in zip(hit[0], deps)):
        return hit[1]
    staged = tuple(n for n, m in zip(names, layers)
                   if linear_reason(n, m, dtype) is None
                   and not is_row_sharded(m)
                   and (dispatch is None or dispatch.admits([weight_of(m)])))
    memo[(names, dtype)] = (deps, staged)
    return staged


def _weight_dep(layer):
    """The weight object :func:`stage_names`' answer depends on: a quantized layer's weight
    view (kept while its arrays are), else the layer's ``weight`` entry (None without one)."""
    if isinstance(layer, nn.QuantizedLinear) or type(layer) in QUANTIZED_SHARDED:
        return weight_of(layer)
    return layer.get("weight")


#: Where :func:`stage_names` keeps its answers (the mixer module's ``__dict__``).
STAGES_MEMO = "_bricks_stages"


def run_linear(run, module, name, x):
    """``module[name](x)`` as a ``linear`` piece of a mixer of several pieces
    (``nn.mixer``: ``run(name, kind, args, stock)``, brick or the layer itself as chosen)."""
    layer = module[name]
    return run(name, KIND, lambda: linear_args(layer, x), lambda: layer(x))


def run_out(run, module, name, o):
    """An output projection ``module[name](o)`` as a ``linear`` piece (as :func:`run_linear`),
    a row-sharded layer's partial product reduced as the layer does (:func:`finish`)."""
    layer = module[name]
    y = run(name, KIND, lambda: linear_args(layer, o), lambda: out_stock(layer, o))
    return finish(layer, y)


def projector(staged, run):
    """``proj(module, name, x)``: a projection of ``staged`` as a ``linear`` stage through the
    mixer's ``run`` (brick or stock, as the dispatch chose), any other the module's own
    layer."""
    staged = frozenset(staged)

    def proj(m, name, x):
        if name not in staged:
            return m[name](x)
        return run(name, KIND, linear_args(m[name], x))
    return proj
