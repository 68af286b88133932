"""The Q8_0 format of K/V (ggml's ``block_q8_0``: 32 int8 values and one float16 scale).

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

This module is the format's definition (the reference arithmetic in MLX ops, the checks of a
``(qs, d)`` pair); the kernels that quantize and dequantize are the ``q8_0`` brick
(``mlx_bricks.bricks.q8_0``), and the attention bricks read the blocks directly.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.checks import check_array, check_float_dtype, dtype_name

QK8_0 = 32
#: The largest finite float16 (the guarded scale), and the smallest float32 that rounds to an
#: infinite float16 (``Q8_0_D_MAX`` / ``Q8_0_D_INF`` in metal_src/q8_0.h).
D_MAX = 65504.0
D_INF = 65520.0
#: The ``kv_quant`` values of the attention bricks: full precision, or Q8_0 K/V.
KV_QUANTS = (None, "q8_0")


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
    check_quantize(x)
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
    check_dequantize(qs, d, dtype)
    *lead, D = qs.shape
    blocks = qs.astype(mx.float32).reshape(*lead, D // QK8_0, QK8_0)
    return (blocks * d.astype(mx.float32)[..., None]).reshape(*lead, D).astype(dtype)


def check_quantize(x) -> None:
    check_array("x", x, min_ndim=1)
    check_float_dtype("x", x)
    D = x.shape[-1]
    if D == 0 or D % QK8_0:
        raise ValueError(
            f"x's last dimension must be a positive multiple of {QK8_0} for Q8_0, "
            f"got shape {tuple(x.shape)}"
        )


def check_dequantize(qs, d, dtype) -> None:
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


def check_kv_quant(kv_quant) -> bool:
    """True for ``kv_quant="q8_0"``, False for None.

    Raises:
        ValueError: anything else.
    """
    if kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
    return kv_quant == "q8_0"


def check_kv(name: str, x, q, quantized: bool) -> tuple:
    """Shape ``(B, Hkv, Lk, D)`` of an attention op's ``k`` or ``v`` argument: an array of q's
    dtype, or (with ``quantized``) a Q8_0 pair ``(qs, d)``, qs int8 (B, Hkv, Lk, D) and d
    float16 (B, Hkv, Lk, D // 32), as :func:`quantize_q8_0_reference` and a Q8_0 KV cache
    give them.

    Raises:
        TypeError: not an array / pair, a pair without ``quantized``, wrong dtypes, a pair of
            another length.
        ValueError: wrong ranks, or d's shape not (..., D // 32).
    """
    if isinstance(x, tuple):
        if not quantized:
            raise TypeError(f"{name} may be a (qs, d) tuple only with kv_quant='q8_0'")
        if len(x) != 2:
            raise TypeError(f"{name} as a Q8_0 tuple must be (qs, d), got {len(x)} items")
        qs, d = x
        check_array(f"{name}[0] (qs)", qs, ndim=4)
        check_array(f"{name}[1] (d)", d, ndim=4)
        if qs.dtype != mx.int8:
            raise TypeError(f"{name}[0] (qs) must be int8, got {dtype_name(qs.dtype)}")
        if d.dtype != mx.float16:
            raise TypeError(f"{name}[1] (d) must be float16, got {dtype_name(d.dtype)}")
        want = (*qs.shape[:-1], qs.shape[-1] // QK8_0)
        if tuple(d.shape) != want:
            raise ValueError(f"{name}[1] (d) must have shape {want}, got {tuple(d.shape)}")
        return tuple(qs.shape)
    check_array(name, x, ndim=4)
    if x.dtype != q.dtype:
        raise TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but q has {dtype_name(q.dtype)}; "
            "mixed dtypes are not supported"
        )
    return tuple(x.shape)


def kv_dense(x, dtype):
    """The values an attention brick attends over for ``kv_quant="q8_0"``: a ``(qs, d)`` pair
    dequantized, or a full-precision array's Q8_0 round trip, in ``dtype`` (MLX ops)."""
    qs_d = x if isinstance(x, tuple) else quantize_q8_0_reference(x)
    return dequantize_q8_0_reference(*qs_d, dtype)
