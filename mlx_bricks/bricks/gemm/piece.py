"""The GEMM brick's pieces in a patched mlx-lm module: a linear layer's arguments for the
``linear`` kind, its stock path, and the finish of a row-sharded output projection.

A piece is what a patched module hands the dispatch for one part of its prefill: the op kind,
the arguments (built from the module's own layers), and the stock computation (the layer
itself). Tensor-parallel layers (``formats.layers``): for a row-sharded o/down the piece
computes the local partial product (no bias, no residual), then :func:`finish` applies the
layer's ``all_sum``, its bias and the residual once.
"""
from __future__ import annotations

import weakref

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.gemm.kind import LINEAR
from mlx_bricks.formats.layers import (
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
    layers = tuple(module.get(n) for n in names)
    # Asked on every call of the mixer: the answer is kept in the module's __dict__ while
    # what it depends on is unchanged (:func:`_depends`), holding none of it alive.
    objs, vals = _depends(dispatch, layers)
    memo = module.__dict__.setdefault(STAGES_MEMO, {})
    key = (names, str(dtype))
    hit = memo.get(key)
    if hit is not None and hit[1] == vals and len(hit[0]) == len(objs) and all(
            r() is o for r, o in zip(hit[0], objs)):
        return hit[2]
    staged = tuple(n for n, m in zip(names, layers)
                   if linear_reason(n, m, dtype) is None
                   and not is_row_sharded(m)
                   and (dispatch is None or dispatch.admits([weight_of(m)])))
    if objs is not None:
        memo[key] = (tuple(weakref.ref(o) for o in objs), vals, staged)
    return staged


#: A layer's arrays :func:`stage_names`' answer depends on (besides the layer itself).
_ARRAYS = ("weight", "scales", "biases", "bias", "global_scale")


def _depends(dispatch, layers):
    """``(objects, values)`` :func:`stage_names`' answer depends on: the dispatch, the layers
    and their arrays (compared by identity, through weak references), and the layers' types,
    formats and arrays' dtypes and shapes (an in-place update keeps an array's identity but
    may change its dtype), and where the dispatch has composites only, whether MLX runs on
    the CPU (``Dispatch.admits``). ``(None, None)`` for a layer that is not a module (not
    kept)."""
    objs, vals = [dispatch], []
    if dispatch is not None and getattr(dispatch, "composites_only", False):
        from mlx_bricks.cpu import on_cpu

        vals.append(on_cpu())
    for m in layers:
        if m is None:
            vals.append(None)
            continue
        if not isinstance(m, nn.Module):
            return None, None
        objs.append(m)
        vals.append((type(m), getattr(m, "group_size", None), getattr(m, "bits", None),
                     getattr(m, "mode", None)))
        for name in _ARRAYS:
            a = m.get(name)
            if isinstance(a, mx.array):
                objs.append(a)
                vals.append((name, str(a.dtype), tuple(a.shape)))  # (a Dtype cannot be copied)
            elif a is not None:
                return None, None
    if dispatch is None:
        objs = objs[1:]
    return objs, tuple(vals)


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
