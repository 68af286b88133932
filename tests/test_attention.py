"""FlashAttention brick: against a float64 numpy softmax attention with the dtype-scaled rule.

The naive comparison is ``softmax((q @ k^T) * scale + mask) @ v`` in MLX ops in the input dtype.
The default suite runs a covering subset of the issue's sweep (every value of every axis
appears); the full cross product is ``@pytest.mark.slow``.
"""
import itertools
import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.ops.attention import (
    SUPPORTED_HEAD_DIMS,
    THREADGROUP_MEMORY_LIMIT,
    _launch_attention,
    attention_tile_config,
    flash_attention,
)
from mlx_bricks.ops.q8_0 import dequantize_q8_0_reference, quantize_q8_0, quantize_q8_0_reference
from tests.support import sampled
from tests.tolerance import EPS, assert_dtype_close, to_f64

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
DTYPES = (F16, BF16, F32)


# ---------------------------------------------------------------------------------------------
# references


def attention64(q, k, v, scale, causal):
    """Softmax attention in float64 numpy; GQA by head repetition; causal aligned bottom-right;
    a row with no visible key is 0."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    Lq, Lk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if causal:
        visible = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return np.matmul(p, v) / np.where(l > 0, l, 1.0)


def naive_attention(q, k, v, scale, causal):
    """The same-dtype MLX computation the tolerance rule compares with."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if causal:
        Lq, Lk = q.shape[2], k.shape[2]
        visible = mx.arange(Lk)[None, :] <= mx.arange(Lq)[:, None] + (Lk - Lq)
        s = s + mx.where(visible, 0.0, -float("inf")).astype(q.dtype)
    return mx.softmax(s, axis=-1) @ v


def q8_round_trip(x):
    """K/V exactly as the kernel sees them with kv_quant='q8_0' (dequantized to x's dtype)."""
    return dequantize_q8_0_reference(*quantize_q8_0_reference(x), x.dtype)


def make_qkv(B, Lq, off, Hq, Hkv, D, dtype, seed):
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return rand(B, Hq, Lq, D), rand(B, Hkv, Lq + off, D), rand(B, Hkv, Lq + off, D)


def q8_bound(q, k, v, kd, vd, scale):
    """Per-row bound on |attention(k, v) - attention(kd, vd)| in exact arithmetic.

    The scores move by |s'_ij - s_ij| = scale |q_i . (kd_j - k_j)| <= delta_i, so every
    probability of row i moves by a factor in [e^-2delta_i, e^2delta_i] and
    ||p' - p||_1 <= e^(2 delta_i) - 1. Since both rows of p sum to 1,
    |p'v' - pv| <= max|v' - v| + ||p' - p||_1 * max_d (max_j v_jd - min_j v_jd) / 2.
    Shape (B, Hq, Lq, 1).
    """
    qf, kf, vf, kdf, vdf = (to_f64(a) for a in (q, k, v, kd, vd))
    rep = qf.shape[1] // kf.shape[1]
    dk = np.repeat(kdf - kf, rep, axis=1)
    delta = scale * np.abs(np.matmul(qf, np.swapaxes(dk, -1, -2))).max(-1, keepdims=True)
    half_range = ((vf.max(axis=2) - vf.min(axis=2)) / 2).max()
    return np.abs(vdf - vf).max() + np.expm1(2 * delta) * half_range


# ---------------------------------------------------------------------------------------------
# the sweep

AXES = dict(
    Lq=(1, 7, 33, 100, 257),
    off=(0, 5, 300),
    heads=((4, 4), (8, 2), (12, 4), (9, 3)),
    D=SUPPORTED_HEAD_DIMS,
    dtype=DTYPES,
    causal=(False, True),
    q8=(False, True),
)

# (B, Lq, Lk - Lq, (Hq, Hkv), D, dtype, causal, kv_quant q8_0): each value of each axis appears.
COVERING = [
    (1, 1, 300, (4, 4), 64, F16, True, False),
    (1, 7, 0, (8, 2), 80, BF16, False, False),
    (2, 33, 5, (9, 3), 96, F32, True, True),
    (1, 100, 0, (12, 4), 128, F16, True, True),
    (1, 257, 5, (4, 4), 64, BF16, True, False),
    (1, 7, 300, (9, 3), 256, F32, False, True),
    (1, 33, 0, (8, 2), 256, BF16, True, False),
    (1, 100, 300, (4, 4), 128, F32, False, False),
    (1, 257, 0, (8, 2), 96, F16, True, True),
    (1, 1, 5, (12, 4), 80, F32, True, False),
]

# The full product, grouped by (D, dtype, kv_quant) to keep the number of test ids small.
FULL_GROUPS = [(D, dtype, q8) for D in AXES["D"] for dtype in DTYPES for q8 in (False, True)
               if not (q8 and D % 32)]


def full_cases(D, dtype, q8):
    return [(1, Lq, off, heads, D, dtype, causal, q8)
            for Lq, off, heads, causal in itertools.product(
                AXES["Lq"], AXES["off"], AXES["heads"], AXES["causal"])]


def case_id(case):
    B, Lq, off, (Hq, Hkv), D, dtype, causal, q8 = case
    dt = str(dtype).split(".")[-1]
    return (f"B{B}-Lq{Lq}-off{off}-h{Hq}x{Hkv}-D{D}-{dt}-{'causal' if causal else 'full'}"
            f"{'-q8' if q8 else ''}")


def test_covering_subset_covers_every_axis_value():
    for i, (name, values) in enumerate(AXES.items()):
        seen = {c[i + 1] for c in COVERING}
        assert set(values) <= seen, f"axis {name}: {set(values) - seen} missing"
    assert all(not (c[7] and c[4] % 32) for c in COVERING)


def check_case(backend, case):
    B, Lq, off, (Hq, Hkv), D, dtype, causal, q8 = case
    q, k, v = make_qkv(B, Lq, off, Hq, Hkv, D, dtype, seed=zlib.crc32(case_id(case).encode()))
    scale = D**-0.5
    mask = "causal" if causal else None
    before = kernels.LAUNCH_COUNTS[("flash_attention", backend)]
    out = flash_attention(q, k, v, scale=scale, mask=mask, kv_quant="q8_0" if q8 else None,
                          backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    if backend != "reference":
        assert kernels.LAUNCH_COUNTS[("flash_attention", backend)] == before + 1
    kd, vd = (q8_round_trip(k), q8_round_trip(v)) if q8 else (k, v)
    ref = attention64(q, kd, vd, scale, causal)
    assert_dtype_close(out, ref, naive_attention(q, kd, vd, scale, causal), dtype=dtype,
                       what=case_id(case))
    if q8:
        # Stated bound of Q8_0 against full precision: the exact-arithmetic bound of q8_bound
        # plus the kernel's own dtype budget.
        full = attention64(q, k, v, scale, causal)
        err = np.abs(to_f64(out) - full)
        slack = np.abs(to_f64(out) - ref).max() + 4 * EPS[dtype]
        assert np.all(err <= q8_bound(q, k, v, kd, vd, scale) + slack)
        # And the typical error for N(0, 1) data is far below that bound: under 2% RMS.
        rms = np.sqrt(np.mean(err**2) / np.mean(full**2))
        assert rms < 0.02, f"Q8_0 relative RMS error {rms:.3g}"


@pytest.mark.parametrize("case", COVERING, ids=case_id)
def test_attention_matches_float64(kernel_backend, case):
    check_case(kernel_backend, case)


# About one case in SAMPLE_ONE_IN of the full sweep, a fixed hash-chosen sample
# (tests.support.sampled), runs in the default suite; the whole sweep is marked slow.
SAMPLE_ONE_IN = 60
SAMPLED = [c for g in FULL_GROUPS for c in full_cases(*g) if sampled(case_id(c), SAMPLE_ONE_IN)]


@pytest.mark.parametrize("case", SAMPLED, ids=case_id)
def test_attention_sweep_sample(kernel_backend, case):
    check_case(kernel_backend, case)


@pytest.mark.slow
@pytest.mark.parametrize("group", FULL_GROUPS,
                         ids=lambda g: f"D{g[0]}-{str(g[1]).split('.')[-1]}{'-q8' if g[2] else ''}")
def test_attention_full_sweep(kernel_backend, group):
    for case in full_cases(*group):  # 120 cases; a failure names its case
        check_case(kernel_backend, case)


# ---------------------------------------------------------------------------------------------
# edge cases


@pytest.mark.parametrize("heads", [(8, 2), (9, 3)])
def test_gqa_head_mapping(kernel_backend, heads):
    # V of KV head j in batch b is the constant 10 b + j + 1, so every output row of query head h
    # must equal 10 b + h // (Hq // Hkv) + 1 whatever the softmax weights are.
    Hq, Hkv = heads
    q, k, _ = make_qkv(2, 9, 4, Hq, Hkv, 64, F16, seed=5)
    const = 10 * np.arange(2)[:, None] + np.arange(Hkv)[None, :] + 1.0
    v = mx.array(np.broadcast_to(const[:, :, None, None], (2, Hkv, 13, 64))).astype(F16)
    out = to_f64(flash_attention(q, k, v, scale=0.125, mask="causal", backend=kernel_backend))
    want = 10 * np.arange(2)[:, None] + np.arange(Hq)[None, :] // (Hq // Hkv) + 1.0
    np.testing.assert_allclose(out, np.broadcast_to(want[:, :, None, None], out.shape), rtol=2e-3)


def test_row_without_visible_key_is_zero(msl_backend):
    # Unreachable through flash_attention (Lk >= Lq), so call the kernel with Lq > Lk: causal
    # rows 0 .. Lq - Lk - 1 see no key and must come out 0 through the kernel's guard, not NaN.
    q, _, _ = make_qkv(1, 45, 0, 4, 2, 64, F32, seed=6)
    _, k, v = make_qkv(1, 20, 0, 4, 2, 64, F32, seed=7)
    out = _launch_attention(q, k, v, None, None, 0.125, True, msl_backend)
    got = to_f64(out)
    assert np.all(np.isfinite(got))
    assert not got[:, :, :25].any()
    ref = attention64(q, k, v, 0.125, True)
    np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_logits_of_magnitude_1e4_stay_finite(kernel_backend, dtype):
    # q, k entries of magnitude 12.5 (exact in every dtype), D = 64, scale 1: |logits| up to 1e4.
    rng = np.random.default_rng(8)
    sign = lambda *s: np.where(rng.random(s) < 0.5, -1.0, 1.0).astype(np.float32)  # noqa: E731
    q = mx.array(12.5 * sign(1, 2, 33, 64)).astype(dtype)
    k = mx.array(12.5 * sign(1, 2, 40, 64)).astype(dtype)
    k = mx.concatenate([k[:, :, :1] * 0 + q[:, :, :1], k[:, :, 1:]], axis=2)  # logit 1e4 at key 0
    v = mx.array(rng.standard_normal((1, 2, 40, 64)).astype(np.float32)).astype(dtype)
    for mask, scale in ((None, 1.0), ("causal", 1.0), ("causal", -1.0)):
        out = to_f64(flash_attention(q, k, v, scale=scale, mask=mask, backend=kernel_backend))
        ref = attention64(q, k, v, scale, mask == "causal")
        assert np.all(np.isfinite(out))
        # float32 scores of size 1e4 carry ~1e-3 absolute error, which moves near-tied weights.
        np.testing.assert_allclose(out, ref, atol=1e-2 * np.abs(ref).max())


def test_future_keys_are_never_read(msl_backend):
    # NaN in K/V at key 40 poisons every row that can see it (40 .. 63), and would poison rows
    # 32 .. 39 of the same query block through 0 * NaN; rows 0 .. 31 (the first query block)
    # stay exact because the causal loop never touches that tile.
    q, k, v = make_qkv(1, 64, 0, 2, 2, 64, F32, seed=9)
    poison = (mx.arange(64) == 40)[None, None, :, None]
    k = mx.where(poison, float("nan"), k)
    v = mx.where(poison, float("nan"), v)
    out = to_f64(flash_attention(q, k, v, scale=0.125, mask="causal", backend=msl_backend))
    ref = attention64(q[:, :, :32], k[:, :, :32], v[:, :, :32], 0.125, True)
    np.testing.assert_allclose(out[:, :, :32], ref, atol=1e-5)
    assert np.isnan(out[:, :, 40:]).all()


def test_strided_inputs_match_contiguous(kernel_backend):
    # As mlx-lm passes them: q/k/v are (B, L, H, D) projections transposed to (B, H, L, D), and
    # the KV cache returns keys[..., :offset, :] of a larger buffer.
    rng = np.random.default_rng(10)
    B, L, Hq, Hkv, D, cap, offset = 2, 21, 8, 2, 64, 64, 37
    proj = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(F16)  # noqa: E731
    q = proj(B, L, Hq, D).transpose(0, 2, 1, 3)
    k_buf, v_buf = proj(B, Hkv, cap, D), proj(B, Hkv, cap, D)
    k, v = k_buf[..., :offset, :], v_buf[..., :offset, :]
    for mask in (None, "causal"):
        want = flash_attention(mx.contiguous(q), mx.contiguous(k), mx.contiguous(v), scale=0.125,
                               mask=mask, backend=kernel_backend)
        got = flash_attention(q, k, v, scale=0.125, mask=mask, backend=kernel_backend)
        assert mx.array_equal(got, want)
    # A Q8_0 cache: (qs, d) slices of larger buffers, against quantizing k/v here.
    kq, vq = quantize_q8_0_reference(k_buf), quantize_q8_0_reference(v_buf)
    sliced = lambda t: (t[0][..., :offset, :], t[1][..., :offset, :])  # noqa: E731
    got = flash_attention(q, sliced(kq), sliced(vq), scale=0.125, mask="causal",
                          kv_quant="q8_0", backend=kernel_backend)
    want = flash_attention(q, k, v, scale=0.125, mask="causal", kv_quant="q8_0",
                           backend=kernel_backend)
    assert mx.array_equal(got, want)


def test_quantized_tuples_equal_quantize_q8_0_output(msl_backend):
    q, k, v = make_qkv(1, 7, 5, 4, 2, 64, BF16, seed=11)
    tup = lambda x: quantize_q8_0(x, backend=msl_backend)  # noqa: E731
    a = flash_attention(q, tup(k), tup(v), scale=0.125, kv_quant="q8_0", backend=msl_backend)
    b = flash_attention(q, k, v, scale=0.125, kv_quant="q8_0", backend=msl_backend)
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("D", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_threadgroup_memory_fits_32kb(D, dtype):
    bq, bk, nbytes = attention_tile_config(D, dtype)
    pad = 16 // dtype.size
    assert nbytes == (D * (bk + pad) + bk * (D + pad)) * dtype.size
    assert nbytes <= THREADGROUP_MEMORY_LIMIT == 32768
    assert bq == 32 and bk in (8, 16, 32) and D % 8 == 0


# ---------------------------------------------------------------------------------------------
# argument errors

Q = mx.zeros((1, 4, 8, 64), F16)
KV = mx.zeros((1, 2, 8, 64), F16)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(mask=mx.zeros((8, 8), mx.bool_)), ValueError, "array masks are not supported"),
        (dict(mask="sliding"), ValueError, "mask must be None or 'causal'"),
        (dict(kv_quant="q4_0"), ValueError, "kv_quant must be None or 'q8_0'"),
        (dict(q=mx.zeros((1, 4, 8, 80), F16), k=mx.zeros((1, 2, 8, 80), F16),
              v=mx.zeros((1, 2, 8, 80), F16), kv_quant="q8_0"), ValueError, "head_dim % 32"),
        (dict(q=mx.zeros((1, 4, 8, 72), F16), k=mx.zeros((1, 2, 8, 72), F16),
              v=mx.zeros((1, 2, 8, 72), F16)), ValueError, "head_dim 72 is not supported"),
        (dict(k=mx.zeros((1, 2, 5, 64), F16), v=mx.zeros((1, 2, 5, 64), F16)), ValueError,
         r"must be >= q length"),
        (dict(k=mx.zeros((1, 3, 8, 64), F16), v=mx.zeros((1, 3, 8, 64), F16)), ValueError,
         "multiple of k/v's heads"),
        (dict(v=mx.zeros((1, 2, 9, 64), F16)), ValueError, "same shape"),
        (dict(k=mx.zeros((1, 2, 8, 64), F32)), TypeError, "mixed dtypes"),
        (dict(q=mx.zeros((1, 4, 8, 64), mx.int32)), TypeError, "q must be float16"),
        (dict(q=mx.zeros((4, 8, 64), F16)), ValueError, "q must have 4 dimensions"),
        (dict(scale="0.1"), TypeError, "scale must be a Python float"),
        (dict(k=(mx.zeros((1, 2, 8, 64), mx.int8), mx.zeros((1, 2, 8, 2), F16))), TypeError,
         "only with kv_quant='q8_0'"),
        (dict(k=(mx.zeros((1, 2, 8, 64), mx.int8), mx.zeros((1, 2, 8, 3), F16)),
              kv_quant="q8_0"), ValueError, r"k\[1\] \(d\) must have shape"),
        (dict(k=(mx.zeros((1, 2, 8, 64), F16), mx.zeros((1, 2, 8, 2), F16)),
              kv_quant="q8_0"), TypeError, r"k\[0\] \(qs\) must be int8"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, exc, match):
    args = dict(q=Q, k=KV, v=KV, scale=0.125, backend="reference")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
