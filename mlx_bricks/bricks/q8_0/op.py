"""The Q8_0 brick: kernels that quantize K/V to Q8_0 blocks and dequantize them.

The format (ggml's ``block_q8_0``, its reference arithmetic and checks) is
``mlx_bricks.formats.q8_0``; the references are re-exported here beside the ops.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import resolve_backend
from mlx_bricks.formats.q8_0 import (  # noqa: F401  (re-exported)
    QK8_0,
    check_dequantize,
    check_quantize,
    dequantize_q8_0_reference,
    quantize_q8_0_reference,
)

_THREADS = 256  # threads per threadgroup of the Q8_0 kernels (a multiple of 32)

kernels.register(kernels.KernelSpec(
    name="q8_0_quantize",
    body="q8_0_quantize.metal",
    input_names=("x",),
    output_names=("qs", "d"),
    headers=("q8_0.h",),
    ensure_row_contiguous=False,
))
kernels.register(kernels.KernelSpec(
    name="q8_0_dequantize",
    body="q8_0_dequantize.metal",
    input_names=("qs", "d"),
    output_names=("out",),
    headers=("q8_0.h",),
    ensure_row_contiguous=False,
))


def quantize_q8_0(x, *, backend=None):
    """Quantize ``x`` to Q8_0 blocks of 32 along the last axis.

    Args:
        x: (..., D) float16, bfloat16 or float32, ``D % 32 == 0``; any strides (views are read
            in place, not copied).
        backend: ``None`` (auto), ``"metal"``, ``"emulator"`` or ``"reference"``.

    Returns:
        ``(qs, d)``: qs int8 (..., D) and d float16 (..., D // 32), both row-contiguous, with
        ggml's semantics (``mlx_bricks.formats.q8_0``): ``d = amax / 127``, ``q = roundf(x * (1 / d))`` in
        [-127, 127]; an all-zero block gives ``d = 0`` and zeros; a block with ``amax`` above
        about 8.32e6 gets the largest float16 scale, 65504, and saturated quants (guarded:
        finite where ggml's scale would be inf).

    Raises:
        TypeError: x is not an mx.array of a float dtype.
        ValueError: x is 0-d or its last dimension is not a positive multiple of 32, or a bad
            backend.

    Kernel: ``metal_src/q8_0_quantize.metal``, one thread per value, one SIMD-group per block
    (amax is a ``simd_max``); a row-contiguous x is indexed directly, a strided view through
    32-bit index arithmetic.
    """
    check_quantize(x)
    name = resolve_backend(backend)
    if name == "reference":
        return quantize_q8_0_reference(x)
    n = x.size
    if n == 0:
        return quantize_q8_0_reference(x)
    qs, d = kernels.launch(
        "q8_0_quantize", name,
        inputs=[x],
        grid=(n, 1, 1),
        threadgroup=(min(_THREADS, n), 1, 1),
        output_shapes=[tuple(x.shape), (*x.shape[:-1], x.shape[-1] // QK8_0)],
        output_dtypes=[mx.int8, mx.float16],
    )
    return qs, d


def dequantize_q8_0(qs, d, *, dtype=mx.float16, backend=None):
    """Dequantize Q8_0 blocks: ``qs * d`` per block of 32, computed in float32, cast to ``dtype``.

    Args:
        qs: int8 (..., D), ``D % 32 == 0``; any strides.
        d: float16 (..., D // 32) scales; any strides.
        dtype: output dtype, float16 (default), bfloat16 or float32.
        backend: ``None`` (auto), ``"metal"``, ``"emulator"`` or ``"reference"``.

    Returns:
        (..., D) array of ``dtype``, row-contiguous.

    Raises:
        TypeError: non-arrays, qs not int8, d not float16, or an unsupported ``dtype``.
        ValueError: D not a positive multiple of 32, d's shape not (..., D // 32), or a bad
            backend.
    """
    check_dequantize(qs, d, dtype)
    name = resolve_backend(backend)
    if name == "reference":
        return dequantize_q8_0_reference(qs, d, dtype)
    n = qs.size
    if n == 0:
        return dequantize_q8_0_reference(qs, d, dtype)
    (out,) = kernels.launch(
        "q8_0_dequantize", name,
        inputs=[qs, d],
        grid=(n, 1, 1),
        threadgroup=(min(_THREADS, n), 1, 1),
        output_shapes=[tuple(qs.shape)],
        output_dtypes=[dtype],
        template=[("T", dtype)],
    )
    return out
