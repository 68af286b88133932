"""Float64 models of MLX affine dequantization, rounded exactly (tests only).

``unpack`` reads MLX's packed words (value k of a row at bits [k bits, (k + 1) bits) of the
row's little-endian bit stream); ``dequantize_model`` gives T(s * q + b) with the exact value
rounded once to nearest even (``fused=True``: what MLX's CUDA dequantize computes on sm_90, and
what the CUDA twins compute) or T(T(s * q) + b), each operation rounded (``fused=False``: MLX's
CPU dequantize). Results are float64 arrays holding T values exactly.
"""
from __future__ import annotations

import numpy as np

# (precision p, smallest normal exponent, largest finite value)
FORMATS = {"float16": (11, -14, 65504.0), "bfloat16": (8, -126, 3.3895313892515355e38),
           "float32": (24, -126, 3.4028234663852886e38)}


def unpack(w: np.ndarray, bits: int, K: int) -> np.ndarray:
    """(N, K) int64 codes of packed uint32 words w (N, K * bits / 32)."""
    by = np.ascontiguousarray(w.astype(np.uint32)).view(np.uint8)
    stream = np.unpackbits(by, axis=1, bitorder="little")[:, :K * bits]
    return (stream.reshape(w.shape[0], K, bits).astype(np.int64) << np.arange(bits)).sum(-1)


def round_to(s: np.ndarray, e: np.ndarray, fmt: str) -> np.ndarray:
    """Round the exact values s + e (float64 s, |e| at most half an ulp of s) to nearest even
    in ``fmt``; float64 result. Overflow gives inf."""
    p, emin, vmax = FORMATS[fmt]
    s = np.asarray(s, np.float64)
    e = np.broadcast_to(np.asarray(e, np.float64), s.shape)
    a = np.abs(s)
    ea = np.where(s < 0, -e, e)
    _, ex = np.frexp(np.where(a > 0, a, 1.0))
    ue = np.maximum(ex - 1, emin) - (p - 1)
    m = np.ldexp(a, -ue)
    fl = np.floor(m)
    frac = m - fl
    up = (frac > 0.5) | ((frac == 0.5) & ((ea > 0) | ((ea == 0) & (np.fmod(fl, 2) != 0))))
    r = np.ldexp(fl + up, ue)
    r = np.where(a == 0, 0.0, r)
    r = np.where(r > vmax, np.inf, r)
    return np.where(s < 0, -r, r)


def _two_sum(a, b):
    s = a + b
    bp = s - a
    return s, (a - (s - bp)) + (b - bp)


def dequantize_model(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                     group_size: int, fmt: str, fused: bool = True) -> np.ndarray:
    """(N, K) float64 values of the affine weight as ``fmt`` holds them.

    Args:
        w: packed uint32 (N, K * bits / 32); scales, biases: (N, K / group_size) float64 arrays
            holding ``fmt`` values (of the output dtype).
        fused: True: T(s q + b) rounded once; False: T(T(s q) + b).
    """
    K = w.shape[1] * 32 // bits
    q = unpack(w, bits, K).astype(np.float64)
    s = np.repeat(np.asarray(scales, np.float64), group_size, axis=1)
    b = np.repeat(np.asarray(biases, np.float64), group_size, axis=1)
    prod = s * q  # exact: at most 24 + 8 significant bits
    if not fused:
        prod = round_to(prod, 0.0, fmt)
    total, err = _two_sum(prod, b)
    return round_to(total, np.where(np.isfinite(total), err, 0.0), fmt)
