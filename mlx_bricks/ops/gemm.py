"""Bricks 1 and 2: tiled GEMM for nn.Linear layout, ``y = x @ weight.T (+ bias) (+ residual)``."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.backends import resolve_backend
from mlx_bricks.ops._checks import check_array, check_float_dtype, check_same_dtype


def linear_reference(x, weight, bias=None, residual=None):
    """Reference of :func:`linear` in MLX ops (what the ``reference`` backend runs)."""
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return y


def _check_linear(x, weight, bias, residual):
    check_array("x", x, min_ndim=1)
    check_array("weight", weight, ndim=2)
    check_float_dtype("x", x)
    check_same_dtype("x", x, weight=weight, bias=bias, residual=residual)
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"x must have a non-empty last dimension (K), got shape {tuple(x.shape)}")
    if weight.shape[1] != K:
        raise ValueError(
            f"weight must have shape (N, K={K}) as nn.Linear stores it, got {tuple(weight.shape)}"
        )
    N = weight.shape[0]
    if bias is not None:
        check_array("bias", bias)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        check_array("residual", residual)
        out_shape = (*x.shape[:-1], N)
        if tuple(residual.shape) != out_shape:
            raise ValueError(
                f"residual must have the output shape {out_shape}, got {tuple(residual.shape)}"
            )


def linear(x, weight, bias=None, residual=None, *, backend=None):
    """``y = x @ weight.T (+ bias) (+ residual)`` on the GEMM brick.

    Args:
        x: (..., K) float16, bfloat16 or float32; M is the product of the leading dims.
        weight: (N, K), same dtype, as ``nn.Linear`` stores it.
        bias: optional (N,), same dtype.
        residual: optional (..., N), same dtype; added in the epilogue.
        backend: ``None`` (auto), ``"metal"``, ``"emulator"``, ``"reference"``
            (see ``mlx_bricks.backends``).

    Returns:
        (..., N) array of x's dtype; accumulation in float32.

    Raises:
        TypeError: non-array arguments, non-float dtypes, or mixed dtypes.
        ValueError: shapes that do not match, or a bad backend.
    """
    _check_linear(x, weight, bias, residual)
    name = resolve_backend(backend)
    if name == "reference":
        return linear_reference(x, weight, bias, residual)
    raise NotImplementedError(f"the GEMM brick is not yet available on backend {name!r}")
