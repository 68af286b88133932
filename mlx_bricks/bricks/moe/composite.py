"""The MoE kind's composite ``dequant``: ``SwitchGLU``'s computation with its quantized expert
weights (MLX affine, or the microscaling modes ``mxfp4`` / ``nvfp4`` / ``mxfp8`` that gpt-oss
ships) dequantized in tiles under the cap, then ``mx.gather_mm`` on the float weights.

The order is ``SwitchGLU.__call__``'s (mlx-lm 0.32, :func:`~mlx_bricks.bricks.moe.op.
moe_mlp_reference`): the rows sorted by expert from 64 on, gate and up, the activation, down,
the un-sort. Each projection is tiled over its output features: a tile is rows ``n0:n1`` of
every expert, ``(E, n, K)``, dequantized with ``mx.dequantize`` (per-expert ``global_scale``
included), multiplied by ``gather_mm`` with the rows' expert indices, its bias added; gate and
up tiles side by side with the activation applied per tile (it is elementwise), then the down
projection's tiles over D. A tile's rows are as many as fit the cap (``DenseTiles``'s rule,
``bricks/dequantize/composite.py``: the dequantizer's peak bytes per value, gate and up counted
together, at least one row; a default cap raised on a GPU to the projection's output bytes),
and each tile's packed arrays wait (``mx.depends``) for the previous tile's output, so one tile
is alive at a time.

Dequantizing every expert costs O(E N D) per call against the grouped GEMM's O(tokens k N D):
it pays at prefill sizes, where most experts see rows (the tuner weighs it against stock per
shape bucket). Precision: the projections are rounded to x's dtype before the activation, as
stock rounds them. On the CPU, whose ``gather_mm`` takes float32 only (MLX 0.32), the weights
are dequantized to float32 and the rows cast to float32 for the products (exact values, float32
sums), each projection rounded to x's dtype after.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx

from mlx_bricks.bricks.dequantize.composite import (
    DEQUANTIZERS,
    call_cap,
    cap_is_strict,
    cap_of,
    quantized,
)
from mlx_bricks.bricks.moe.op import (
    ACTIVATION_PARAMS,
    SORT_THRESHOLD,
    activation_reference,
    expert_shape,
)
from mlx_bricks.formats import format_of
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.formats.microscaling import MicroscaledWeight
from mlx_bricks.runtime.kind import Composite

_WEIGHTS = ("w_gate", "w_up", "w_down")


def compute_dtype(dtype):
    """The dtype of the products: ``dtype``, float32 on the CPU (its ``gather_mm``'s only)."""
    return mx.float32 if mx.default_device() == mx.cpu else dtype


def expert_rows(weight, n0: int, n1: int):
    """Rows ``n0:n1`` (axis 1) of every expert of a stacked ``(E, N, K)`` weight."""
    if isinstance(weight, MicroscaledWeight):
        return weight.rows(n0, n1)
    if isinstance(weight, QuantizedWeight):
        return dataclasses.replace(weight, w=weight.w[:, n0:n1], scales=weight.scales[:, n0:n1],
                                   biases=weight.biases[:, n0:n1])
    return weight[:, n0:n1]


def _after(weight, dep):
    """``weight``'s arrays evaluated only after ``dep``."""
    if isinstance(weight, MicroscaledWeight):
        return weight.with_arrays(mx.depends(weight.arrays(), [dep]))
    if isinstance(weight, QuantizedWeight):
        w, s, b = mx.depends([weight.w, weight.scales, weight.biases], [dep])
        return dataclasses.replace(weight, w=w, scales=s, biases=b)
    return mx.depends([weight], [dep])[0]


def _dense(weight, dtype):
    if format_of(weight).quantized:
        return weight.dequantize(dtype)
    return weight.astype(dtype)


def _value_bytes(weight, dtype) -> float:
    """Bytes alive per value of a tile of ``weight`` while it is made (``mx.dequantize``'s
    peak; a float weight's cast copy)."""
    f = format_of(weight)
    if f.quantized:
        return DEQUANTIZERS["mx"].peak(f.bits, dtype, f.mode)
    return dtype.size


class _Tiles:
    """Sequenced, capped tiles of one call (module docstring); ``strict``, ``backend``: a
    default cap is raised per projection to its output bytes on a GPU (``call_cap``)."""

    def __init__(self, cap: int, first, strict: bool, backend: str):
        self.cap = cap
        self.last = first
        self.strict = strict
        self.backend = backend

    def project(self, xs, weights: tuple, biases: tuple, idx, do_sort: bool, out_dtype,
                finish=None):
        """``gather_mm(xs, W.T)[rows' experts] + b[idx]`` for ``weights`` ``(E, N, K)`` side by
        side, per tile of N; each tile's outputs rounded to ``out_dtype`` and passed to
        ``finish`` (default: the single weight's); the tiles concatenated on the last axis."""
        cdt = xs.dtype
        E, N, K = expert_shape(weights[0])
        per_row = E * K * sum(_value_bytes(w, cdt) for w in weights)
        cap = call_cap(self.cap, self.strict, self.backend,
                       idx.size * N * len(weights) * out_dtype.size)
        rows = max(1, min(N, int(cap // max(1.0, per_row))))
        outs = []
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            ys = []
            for w, b in zip(weights, biases):
                wt = _dense(_after(expert_rows(w, n0, n1), self.last), cdt)
                y = mx.gather_mm(xs, wt.swapaxes(-1, -2), rhs_indices=idx,
                                 sorted_indices=do_sort).astype(out_dtype)
                if b is not None:
                    y = y + mx.expand_dims(b[:, n0:n1][idx], -2)
                ys.append(y)
            out = finish(*ys) if finish is not None else ys[0]
            outs.append(out)
            self.last = out
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def dequant_moe(args: dict, backend: str, settings: dict):
    """The ``dequant`` composite's output for the MoE kind's ``args`` (module docstring):
    ``(..., k, D)`` of x's dtype, what ``SwitchGLU(x, indices)`` returns (``SwitchMLP``'s for
    gate-less experts: ``w_gate`` None)."""
    x, indices = args["x"], args["indices"]
    dtype = x.dtype
    cdt = compute_dtype(dtype)
    act = args.get("activation", "silu")
    params = {n: args.get(n) for n, _ in ACTIVATION_PARAMS.get(act, ())}  # None: defaults
    xe = mx.expand_dims(x, (-2, -3))
    do_sort = indices.size >= SORT_THRESHOLD
    idx, inv_order = indices, None
    if do_sort:
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        xe, idx = xe.flatten(0, -3)[order // k], flat[order]
    tiles = _Tiles(cap_of(settings), x, cap_is_strict(settings), backend)
    if args.get("w_gate") is None:  # gate-less experts (SwitchMLP): up, then its activation
        a = tiles.project(xe.astype(cdt), (args["w_up"],), (args.get("b_up"),), idx, do_sort,
                          dtype, finish=lambda u: activation_reference(act, u, None))
    else:
        a = tiles.project(xe.astype(cdt), (args["w_gate"], args["w_up"]),
                          (args.get("b_gate"), args.get("b_up")), idx, do_sort, dtype,
                          finish=lambda g, u: activation_reference(act, u, g, **params))
    y = tiles.project(a.astype(cdt), (args["w_down"],), (args.get("b_down"),), idx, do_sort,
                      dtype)
    if do_sort:
        y = mx.unflatten(y[inv_order], 0, indices.shape)
    return y.squeeze(-2)


#: The MoE kind's composites: ``dequant`` wherever an expert weight is quantized.
COMPOSITES = (Composite("dequant", dequant_moe,
                        lambda args, backend: quantized(*(args[w] for w in _WEIGHTS
                                                          if args.get(w) is not None))),)
