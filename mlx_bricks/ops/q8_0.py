"""Q8_0 quantization of K/V (ggml's ``block_q8_0``: 32 int8 values and one float16 scale).

ggml packs each block as ``{half d; int8_t qs[32]}`` (34 bytes per 32 values). Here the two
fields are separate arrays, ``qs`` int8 ``(..., D)`` and ``d`` float16 ``(..., D // 32)``, so a
Q8_0 KV cache can be sliced like any other; values and arithmetic are ggml's
``quantize_row_q8_0_ref`` / ``dequantize_row_q8_0`` (see ``metal_src/q8_0.h``):

* ``amax = max |x|`` per block of 32 along the last axis, in float32;
* ``d = amax / 127`` in float32, stored as float16 (round to nearest even);
* ``q = roundf(x * id)`` with ``id = 1 / d`` computed from the float32 ``d`` (``id = 0`` when
  ``d == 0``): nearest integer, exact halves away from zero, so ``+-amax -> +-127``, never -128
  (where ggml's float -> int8 cast is undefined, here NaN gives 0 and +-inf gives +-127);
* dequantized value ``q * d`` in float32.

Both divisions are correctly rounded (``precise::divide`` in the kernels, whatever MLX's math
mode). One guard where ggml has none: a block whose ``d`` would round to an infinite float16
(``amax >= 127 * 65520``, about 8.32e6; only bfloat16 or float32 inputs get there) stores the
largest float16, 65504, and quantizes with it (``id = 1 / 65504``), so its quants saturate at
+-127 and it dequantizes to finite values (at most +-8.32e6) instead of ggml's inf and NaN.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import resolve_backend
from mlx_bricks.ops._checks import check_array, check_float_dtype, dtype_name

QK8_0 = 32
_THREADS = 256  # threads per threadgroup of the Q8_0 kernels (a multiple of 32)
#: The largest finite float16 (the guarded scale), and the smallest float32 that rounds to an
#: infinite float16 (``Q8_0_D_MAX`` / ``Q8_0_D_INF`` in metal_src/q8_0.h).
D_MAX = 65504.0
D_INF = 65520.0

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


def _round_half_away(v):
    """C ``roundf`` in float32: nearest integer, exact halves away from zero.

    ``floor(|v| + 0.5)`` is not it: for ``|v| = 0.5 - 2**-25`` the sum rounds up to 1.0.
    The fractional part ``|v| - floor(|v|)`` is exact in float32, so compare that instead.
    """
    a = mx.abs(v)
    f = mx.floor(a)
    r = f + (a - f >= 0.5).astype(v.dtype)
    return mx.where(v < 0, -r, r)


def quantize_q8_0_reference(x):
    """Reference of :func:`quantize_q8_0` in MLX ops (ggml ``quantize_row_q8_0_ref``)."""
    _check_quantize(x)
    *lead, D = x.shape
    blocks = x.astype(mx.float32).reshape(*lead, D // QK8_0, QK8_0)
    # NaN counts as 0 in amax, as in the kernel (so one NaN does not wipe its block).
    amax = mx.max(mx.where(mx.isnan(blocks), 0.0, mx.abs(blocks)), axis=-1, keepdims=True)
    d = amax / mx.array(127.0, mx.float32)
    d = mx.where(d >= D_INF, mx.array(D_MAX, mx.float32), d)  # a finite float16 scale
    inv = mx.where(d != 0, mx.array(1.0, mx.float32) / mx.where(d != 0, d, 1.0), 0.0)
    v = blocks * inv
    # Defined where ggml's float -> int8 cast is not (NaN -> 0, +-inf -> +-127), as the kernel.
    q = mx.where(mx.isnan(v), 0.0, mx.clip(_round_half_away(v), -127, 127))
    return q.astype(mx.int8).reshape(*lead, D), d.squeeze(-1).astype(mx.float16)


def dequantize_q8_0_reference(qs, d, dtype=mx.float16):
    """Reference of :func:`dequantize_q8_0`: ``qs * d`` per block of 32, in float32, then cast."""
    _check_dequantize(qs, d, dtype)
    *lead, D = qs.shape
    blocks = qs.astype(mx.float32).reshape(*lead, D // QK8_0, QK8_0)
    return (blocks * d.astype(mx.float32)[..., None]).reshape(*lead, D).astype(dtype)


def _check_quantize(x) -> None:
    check_array("x", x, min_ndim=1)
    check_float_dtype("x", x)
    D = x.shape[-1]
    if D == 0 or D % QK8_0:
        raise ValueError(
            f"x's last dimension must be a positive multiple of {QK8_0} for Q8_0, "
            f"got shape {tuple(x.shape)}"
        )


def _check_dequantize(qs, d, dtype) -> None:
    check_array("qs", qs, min_ndim=1)
    check_array("d", d, min_ndim=1)
    if qs.dtype != mx.int8:
        raise TypeError(f"qs must be int8, got {dtype_name(qs.dtype)}")
    if d.dtype != mx.float16:
        raise TypeError(f"d must be float16, got {dtype_name(d.dtype)}")
    D = qs.shape[-1]
    if D == 0 or D % QK8_0:
        raise ValueError(
            f"qs's last dimension must be a positive multiple of {QK8_0}, "
            f"got shape {tuple(qs.shape)}"
        )
    want = (*qs.shape[:-1], D // QK8_0)
    if tuple(d.shape) != want:
        raise ValueError(
            f"d must have shape {want} (one scale per 32 values), got {tuple(d.shape)}"
        )
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")


def quantize_q8_0(x, *, backend=None):
    """Quantize ``x`` to Q8_0 blocks of 32 along the last axis.

    Args:
        x: (..., D) float16, bfloat16 or float32, ``D % 32 == 0``; any strides (views are read
            in place, not copied).
        backend: ``None`` (auto), ``"metal"``, ``"emulator"`` or ``"reference"``.

    Returns:
        ``(qs, d)``: qs int8 (..., D) and d float16 (..., D // 32), both row-contiguous, with
        ggml's semantics (module docstring): ``d = amax / 127``, ``q = roundf(x * (1 / d))`` in
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
    _check_quantize(x)
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
    _check_dequantize(qs, d, dtype)
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
