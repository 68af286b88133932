"""Helpers for the quantized-weight tests: MLX affine and microscaled (mxfp4, nvfp4, mxfp8)
weights and their float64 values, decoded here from the packed bits (independently of
``mx.dequantize``: the element and scale codes by their definitions, OCP MX v1.0 and NVFP4)."""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.formats.microscaling import MODES, MicroscaledWeight
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
    """A float weight (``fmt`` None), a quantized one (``fmt`` = (bits, group_size)) or a
    microscaled one (``fmt`` a mode name, ``"mxfp4"``)."""
    if fmt is None:
        return randn((N, K), dtype, seed, scale=1.0 / math.sqrt(K))
    if isinstance(fmt, str):
        return microscaled((N, K), fmt, dtype, seed)
    return quantized(N, K, *fmt, dtype, seed)


def unpack64(q) -> np.ndarray:
    """The (..., N, K) integer values of the packed rows: value k of a row is bits
    [k * bits, (k + 1) * bits) of its little-endian bit stream."""
    w = np.array(q.w)
    *lead, P = w.shape
    rows = int(np.prod(lead))
    stream = np.unpackbits(w.astype("<u4").view(np.uint8).reshape(rows, 4 * P), axis=1,
                           bitorder="little")
    K = P * 32 // q.bits
    v = (stream.reshape(rows, K, q.bits).astype(np.int64) << np.arange(q.bits)).sum(-1)
    return v.reshape(*lead, K)


def e2m1_64(c: np.ndarray) -> np.ndarray:
    """FP4 E2M1 codes: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 subnormal."""
    e, m = (c >> 1) & 3, (c & 1).astype(np.float64)
    v = np.where(e == 0, m * 0.5, (1.0 + m / 2) * np.exp2(e - 1.0))
    return np.where(c & 8, -v, v)


def e4m3_64(c: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (FN) codes: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    subnormal; 0x7f / 0xff NaN; no infinities."""
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1.0 + m / 8) * np.exp2(e - 7.0))
    v = np.where((c & 0x7F) == 0x7F, np.nan, v)
    return np.where(c & 0x80, -v, v)


def e8m0_64(c: np.ndarray) -> np.ndarray:
    """E8M0 scale codes: ``2 ** (c - 127)``, 255 NaN."""
    return np.where(c == 255, np.nan, np.exp2(c.astype(np.float64) - 127.0))


def micro64(q: MicroscaledWeight) -> np.ndarray:
    """float64 (..., N, K) of a microscaled weight: element(q) * scale(group), times
    ``global_scale[e] / (6 * 448)`` per expert when it has one; exact."""
    spec = MODES[q.mode]
    codes = unpack64(q)
    elems = e4m3_64(codes) if spec.element == "e4m3" else e2m1_64(codes)
    sc = np.array(q.scales).astype(np.int64)
    scales = e4m3_64(sc) if spec.scale == "e4m3" else e8m0_64(sc)
    v = elems * np.repeat(scales, spec.group_size, axis=-1)
    if q.global_scale is not None:
        v = v * (to_f64(q.global_scale) / (6 * 448))[:, None, None]
    return v


def microscaled(shape, mode, dtype, seed, *, global_scale=False) -> MicroscaledWeight:
    """``mx.quantize(mode=...)`` of a random ``shape`` weight of ``dtype`` (scale 1 / sqrt(K));
    with ``global_scale`` (nvfp4 experts) each expert quantized with its own, as mlx-lm's
    ``QuantizedSwitchLinear(global_scale=True)`` does."""
    w = randn(shape, dtype, seed, scale=1.0 / math.sqrt(shape[-1]))
    if not global_scale:
        wq, scales = mx.quantize(w, mode=mode)
        return MicroscaledWeight(wq, scales, mode)
    gs = mx.max(mx.abs(w), axis=(-2, -1)).astype(mx.float32)
    parts = [mx.quantize(w[e], mode=mode, global_scale=gs[e]) for e in range(shape[0])]
    return MicroscaledWeight(mx.stack([p[0] for p in parts]), mx.stack([p[1] for p in parts]),
                             mode, gs)


def dequant64(w) -> np.ndarray:
    """float64 (N, K) of a float weight, or of a quantized one: scale * q + bias (affine) or
    element * scale (microscaled), exact."""
    if isinstance(w, MicroscaledWeight):
        return micro64(w)
    if not isinstance(w, QuantizedWeight):
        return to_f64(w)
    s = np.repeat(to_f64(w.scales), w.group_size, axis=-1)
    b = np.repeat(to_f64(w.biases), w.group_size, axis=-1)
    return s * unpack64(w) + b


def even_tiles(n: int, most: int) -> list[int]:
    """The rows of each tile the dequant composites split ``n`` rows into: the fewest tiles of
    at most ``most`` rows, within one row of each other."""
    k = -(-n // most)
    return [(i + 1) * n // k - i * n // k for i in range(k)]


def dequant(w):
    """The same-dtype weight MLX would multiply by: ``mx.dequantize`` (float: as is)."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def product(x, w):
    """Stock MLX's same-dtype ``x @ w.T``: ``mx.quantized_matmul`` for a quantized weight."""
    if isinstance(w, MicroscaledWeight):
        return mx.quantized_matmul(x, w.w, w.scales, None, transpose=True,
                                   group_size=w.group_size, bits=w.bits, mode=w.mode)
    if isinstance(w, QuantizedWeight):
        return mx.quantized_matmul(x, w.w, w.scales, w.biases, transpose=True,
                                   group_size=w.group_size, bits=w.bits)
    return x @ w.T


def silu64(g):
    """float64 SiLU that stays finite for any g (exp of -|g| only)."""
    e = np.exp(-np.abs(g))
    return np.where(g >= 0, g / (1.0 + e), g * e / (1.0 + e))


def gelu_tanh64(g):
    """float64 GELU, tanh approximation (``mlx.nn.gelu_approx``'s formula)."""
    return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def mlp_case(M, K, F, fmts, dtype, bias, residual, activation="silu"):
    """One SwiGLU MLP of random operands, weights in ``fmts`` (gate, up, down): ``(args, ref,
    naive, dt)`` with the swiglu_mlp kind's arguments, the float64 result of the exact
    (dequantized) weights and the same-dtype MLX computation (``product``)."""
    dt = DTYPES[dtype]
    s = M + K + F
    x = randn((M, K), dt, s)
    wg, wu, wd = (weight(F, K, fmts[0], dt, s + 1), weight(F, K, fmts[1], dt, s + 2),
                  weight(K, F, fmts[2], dt, s + 3))
    bg, bu, bd = ((randn((F,), dt, s + 4), randn((F,), dt, s + 5), randn((K,), dt, s + 6))
                  if bias else (None, None, None))
    r = randn((M, K), dt, s + 7) if residual else None
    x64 = to_f64(x)
    g64, u64, g, u = x64 @ dequant64(wg).T, x64 @ dequant64(wu).T, product(x, wg), product(x, wu)
    if bias:
        g64, u64, g, u = g64 + to_f64(bg), u64 + to_f64(bu), g + bg, u + bu
    if activation == "gelu_tanh":
        a64, a = gelu_tanh64(g64) * u64, nn.gelu_approx(g) * u
    else:
        a64, a = silu64(g64) * u64, nn.silu(g) * u
    ref, naive = a64 @ dequant64(wd).T, product(a, wd)
    if bias:
        ref, naive = ref + to_f64(bd), naive + bd
    if residual:
        ref, naive = ref + to_f64(r), r + naive
    args = {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd, "b_gate": bg, "b_up": bu,
            "b_down": bd, "residual": r}
    if activation != "silu":
        args["activation"] = activation
    return args, ref, naive, dt
