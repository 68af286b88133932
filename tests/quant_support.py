"""Helpers for the quantized-weight tests: MLX affine weights and their float64 values, decoded
here from the packed bits (independently of ``mx.dequantize``)."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlx_bricks.formats.affine import QuantizedWeight
from tests.tolerance import to_f64

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def randn(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def quantized(N, K, bits, group_size, dtype, seed) -> QuantizedWeight:
    """``mx.quantize`` of a random (N, K) weight of ``dtype`` (scale 1 / sqrt(K))."""
    w = randn((N, K), dtype, seed, scale=1.0 / math.sqrt(K))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return QuantizedWeight(wq, scales, biases, group_size, bits)


def weight(N, K, fmt, dtype, seed):
    """A float weight (``fmt`` None) or a quantized one (``fmt`` = (bits, group_size))."""
    if fmt is None:
        return randn((N, K), dtype, seed, scale=1.0 / math.sqrt(K))
    return quantized(N, K, *fmt, dtype, seed)


def unpack64(q: QuantizedWeight) -> np.ndarray:
    """The (N, K) integer values of the packed rows: value k of a row is bits
    [k * bits, (k + 1) * bits) of its little-endian bit stream."""
    w = np.array(q.w)
    N, P = w.shape
    stream = np.unpackbits(w.astype("<u4").view(np.uint8).reshape(N, 4 * P), axis=1,
                           bitorder="little")
    K = P * 32 // q.bits
    return (stream.reshape(N, K, q.bits).astype(np.int64) << np.arange(q.bits)).sum(-1)


def dequant64(w) -> np.ndarray:
    """float64 (N, K) of a float weight, or of a quantized one: scale * q + bias, exact."""
    if not isinstance(w, QuantizedWeight):
        return to_f64(w)
    s = np.repeat(to_f64(w.scales), w.group_size, axis=1)
    b = np.repeat(to_f64(w.biases), w.group_size, axis=1)
    return s * unpack64(w) + b


def dequant(w):
    """The same-dtype weight MLX would multiply by: ``mx.dequantize`` (float: as is)."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def product(x, w):
    """Stock MLX's same-dtype ``x @ w.T``: ``mx.quantized_matmul`` for a quantized weight."""
    if isinstance(w, QuantizedWeight):
        return mx.quantized_matmul(x, w.w, w.scales, w.biases, transpose=True,
                                   group_size=w.group_size, bits=w.bits)
    return x @ w.T
