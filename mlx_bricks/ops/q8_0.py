"""Q8_0 quantization of K/V (ggml's ``block_q8_0``: 32 int8 values and one float16 scale)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.backends import resolve_backend

QK8_0 = 32


def quantize_q8_0_reference(x):
    """Reference of :func:`quantize_q8_0` in MLX ops (ggml ``quantize_row_q8_0_ref``)."""
    *lead, D = x.shape
    blocks = x.astype(mx.float32).reshape(*lead, D // QK8_0, QK8_0)
    amax = mx.max(mx.abs(blocks), axis=-1, keepdims=True)
    d = amax / 127.0
    inv = mx.where(d > 0, 1.0 / mx.where(d > 0, d, 1.0), 0.0)
    v = blocks * inv
    q = mx.sign(v) * mx.floor(mx.abs(v) + 0.5)  # round half away from zero, as roundf
    return q.astype(mx.int8).reshape(*lead, D), d.squeeze(-1).astype(mx.float16)


def dequantize_q8_0_reference(qs, d, dtype=mx.float16):
    """Reference of :func:`dequantize_q8_0`: ``qs * d`` per block of 32."""
    *lead, D = qs.shape
    blocks = qs.astype(mx.float32).reshape(*lead, D // QK8_0, QK8_0)
    return (blocks * d.astype(mx.float32)[..., None]).reshape(*lead, D).astype(dtype)


def quantize_q8_0(x, *, backend=None):
    """Quantize ``x`` (..., D) to Q8_0 blocks along the last axis (D % 32 == 0).

    Returns:
        (qs, d): qs int8 (..., D); d float16 (..., D // 32), ``d = amax / 127`` per block.
    """
    name = resolve_backend(backend)
    if name == "reference":
        return quantize_q8_0_reference(x)
    raise NotImplementedError(f"the Q8_0 kernels are not yet available on backend {name!r}")


def dequantize_q8_0(qs, d, *, dtype=mx.float16, backend=None):
    """Dequantize Q8_0 blocks: (qs int8 (..., D), d float16 (..., D // 32)) -> (..., D) dtype."""
    name = resolve_backend(backend)
    if name == "reference":
        return dequantize_q8_0_reference(qs, d, dtype)
    raise NotImplementedError(f"the Q8_0 kernels are not yet available on backend {name!r}")
