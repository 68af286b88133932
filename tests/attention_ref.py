"""References of the attention tests (prefill, decode, the CUDA twin): float64 numpy attention,
the same-dtype MLX computation the tolerance rule compares with, and the Q8_0 K/V bound.

Masks align bottom-right (query i of Lq sits at position p = Lk - Lq + i): causal hides keys
j > p, a window hides j <= p - window, ``kv_start[b]`` hides batch row b's keys j <
kv_start[b] (a left-padded batch); head h's sink logit ``sinks[h]`` is one more softmax column
of value 0. A row that sees no key is 0. GQA repeats each K/V head over its query heads.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_bricks.bricks.q8_0.op import dequantize_q8_0_reference, quantize_q8_0_reference
from tests.tolerance import EPS, to_f64


def visible64(Lq, Lk, causal, window=None, kv_start=None):
    """Boolean mask: (Lq, Lk), or (B, 1, Lq, Lk) with ``kv_start``."""
    pos = np.arange(Lk - Lq, Lk)[:, None]
    keys = np.arange(Lk)[None, :]
    vis = np.ones((Lq, Lk), bool)
    if causal:
        vis &= keys <= pos
    if window is not None:
        vis &= keys > pos - window
    if kv_start is not None:
        vis = vis[None, None] & (keys[None, None] >= np.asarray(kv_start)[:, None, None, None])
    return vis


def attention64(q, k, v, scale, causal, window=None, softcap=None, kv_start=None, sinks=None):
    """Softmax attention in float64 numpy (numpy inputs or mx arrays), masks as the module
    docstring; soft-capping on the scaled score."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(visible64(q.shape[2], k.shape[2], causal, window, kv_start), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = to_f64(sinks)[None, :, None, None]
        m = np.maximum(m, sk)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sk - m)
    return np.matmul(p, v) / np.where(l > 0, l, 1.0)


def naive_attention(q, k, v, scale, causal, window=None, softcap=None, kv_start=None,
                    sinks=None):
    """The same-dtype MLX computation (``mx`` arrays of one dtype), masks as the module
    docstring (sinks: an extra score column, dropped after the softmax)."""
    dtype = q.dtype
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if softcap is not None:
        s = mx.tanh(s / softcap) * softcap
    vis = mx.array(visible64(q.shape[2], k.shape[2], causal, window, kv_start))
    s = mx.where(vis, s, mx.array(-float("inf"), dtype))
    if sinks is not None:
        sinks = sinks if isinstance(sinks, mx.array) else mx.array(np.asarray(sinks, np.float32))
        col = mx.broadcast_to(sinks.astype(dtype).reshape(1, -1, 1, 1), (*s.shape[:-1], 1))
        out = mx.softmax(mx.concatenate([col, s], axis=-1), axis=-1)[..., 1:] @ v
    else:
        out = mx.softmax(s, axis=-1) @ v
    return mx.where(vis.any(axis=-1, keepdims=True), out, mx.array(0, dtype))


def q8_round_trip(x):
    """K/V exactly as the kernel sees them with kv_quant='q8_0' (dequantized to x's dtype)."""
    return dequantize_q8_0_reference(*quantize_q8_0_reference(x), x.dtype)


def make_qkv(B, Lq, Lk, Hq, Hkv, D, dtype, seed):
    """Standard-normal q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D) of ``dtype``."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return rand(B, Hq, Lq, D), rand(B, Hkv, Lk, D), rand(B, Hkv, Lk, D)


def q8_bound(q, k, v, kd, vd, scale):
    """Per-row bound on |attention(k, v) - attention(kd, vd)| in exact arithmetic.

    The scores move by |s'_ij - s_ij| = scale |q_i . (kd_j - k_j)| <= delta_i (soft-capping is
    1-Lipschitz, so also after it), so every probability of row i moves by a factor in
    [e^-2delta_i, e^2delta_i] and ||p' - p||_1 <= e^(2 delta_i) - 1. Since both rows of p sum
    to 1, |p'v' - pv| <= max|v' - v| + ||p' - p||_1 * max_d (max_j v_jd - min_j v_jd) / 2.
    Shape (B, Hq, Lq, 1).
    """
    qf, kf, vf, kdf, vdf = (to_f64(a) for a in (q, k, v, kd, vd))
    rep = qf.shape[1] // kf.shape[1]
    dk = np.repeat(kdf - kf, rep, axis=1)
    delta = scale * np.abs(np.matmul(qf, np.swapaxes(dk, -1, -2))).max(-1, keepdims=True)
    half_range = ((vf.max(axis=2) - vf.min(axis=2)) / 2).max()
    return np.abs(vdf - vf).max() + np.expm1(2 * delta) * half_range


def assert_q8_within_bound(out, ref, full, q, k, v, kd, vd, scale, dtype):
    """A Q8_0 K/V output against full precision: within the exact-arithmetic bound of
    :func:`q8_bound` plus the kernel's own error (against ``ref``, the attention of the rounded
    K/V) and 4 ulps; and, for N(0, 1) data, under 2% relative RMS error."""
    err = np.abs(to_f64(out) - full)
    slack = np.abs(to_f64(out) - ref).max() + 4 * EPS[dtype]
    assert np.all(err <= q8_bound(q, k, v, kd, vd, scale) + slack)
    rms = np.sqrt(np.mean(err**2) / np.mean(full**2))
    assert rms < 0.02, f"Q8_0 relative RMS error {rms:.3g}"
