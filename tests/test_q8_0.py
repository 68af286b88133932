"""Q8_0 quantize/dequantize kernels: bit-exact against ggml's reference (gguf-py's port of
``quantize_row_q8_0_ref``, documented bit-exact), plus known answers and argument errors."""
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from mlx_bricks import kernels
from mlx_bricks.bricks.q8_0.op import (
    dequantize_q8_0,
    dequantize_q8_0_reference,
    quantize_q8_0,
    quantize_q8_0_reference,
)

DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def ggml_q8_0(x: np.ndarray):
    """(qs int8 (..., D), d float16 (..., D/32)) from gguf-py's ggml-exact Q8_0 (float32 input)."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    *lead, D = x32.shape
    raw = quants.quantize(x32.reshape(-1, D), GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(-1, D // 32, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:].copy().view(np.int8).reshape(-1, D)
    return qs.reshape(*lead, D), d.reshape(*lead, D // 32)


def block(values, dtype=mx.float32):
    """One 32-value block (padded with zeros) as a (1, 32) array."""
    row = np.zeros(32, np.float32)
    row[: len(values)] = values
    return mx.array(row[None]).astype(dtype)


def q8(x, backend):
    qs, d = quantize_q8_0(x, backend=backend)
    return np.array(qs), np.array(d)


def test_ggml_oracle_layout_is_read_right():
    # x = 4 j: amax 124, d = fp16(124 / 127), q_j = roundf(4 j * 127 / 124).
    qs, d = ggml_q8_0(4 * np.arange(32, dtype=np.float32)[None])
    assert d[0, 0] == np.float16(np.float32(124) / np.float32(127))
    assert qs[0, [0, 1, 2, 31]].tolist() == [0, 4, 8, 127]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(1, 32), (3, 5, 64), (2, 7, 96)])
def test_quantize_matches_ggml(kernel_backend, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    # Mixed magnitudes per row, plus grids of exact halves after scaling.
    magnitude = 10.0 ** rng.uniform(-4, 3, shape[:-1] + (1,))
    x = rng.standard_normal(shape).astype(np.float32) * magnitude
    x = np.array(mx.array(x).astype(dtype).astype(mx.float32))
    qs, d = q8(mx.array(x).astype(dtype), kernel_backend)
    qs_ref, d_ref = ggml_q8_0(x)
    np.testing.assert_array_equal(qs, qs_ref)
    np.testing.assert_array_equal(d.view(np.uint16), d_ref.view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_exact_halves_round_away_from_zero(kernel_backend, dtype):
    # amax = 127 gives d = 1 and id = 1 exactly, so q = roundf(x).
    vals = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.25, -3.75]
    qs, d = q8(block(vals, dtype), kernel_backend)
    assert d[0, 0] == 1.0
    assert qs[0, : len(vals)].tolist() == [127, 1, 2, 3, -1, -2, -3, 127, -127, 3, -4]


def test_just_below_half_rounds_down(kernel_backend):
    # floor(|v| + 0.5) would round 0.5 - 2**-25 up to 1 (the float32 sum rounds to 1.0).
    v = np.float32(0.5) - np.float32(2.0**-25)
    qs, _ = q8(block([127.0, v, -v]), kernel_backend)
    assert qs[0, 1:3].tolist() == [0, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_amax_maps_to_127_never_minus_128(kernel_backend, dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 128)).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, (64, 1))
    x[::2, ::32] = -np.abs(x[::2, ::32]) * 4  # some blocks whose amax is negative
    xm = mx.array(x).astype(dtype)
    qs, _ = q8(xm, kernel_backend)
    xb = np.array(xm.astype(mx.float32)).reshape(64, 4, 32)
    qb = qs.reshape(64, 4, 32)
    at_amax = np.abs(xb) == np.abs(xb).max(axis=-1, keepdims=True)
    assert np.all(np.abs(qb[at_amax]) == 127)
    assert np.all(np.sign(qb[at_amax]) == np.sign(xb[at_amax]))
    assert qs.min() >= -127 and qs.max() <= 127


def test_all_zero_block_gives_zero_scale_and_zeros(kernel_backend):
    x = mx.concatenate([block([]), block([1.0, -2.0])], axis=1)  # (1, 64): zero block, then not
    qs, d = q8(x, kernel_backend)
    assert d[0].tolist() == [0.0, np.float16(np.float32(2) / np.float32(127))]
    assert not qs[0, :32].any()
    out = np.array(dequantize_q8_0(mx.array(qs), mx.array(d), dtype=mx.float32,
                                   backend=kernel_backend))
    assert np.all(np.isfinite(out)) and not out[0, :32].any()


@pytest.mark.parametrize("amax", [1e-10, 1e-38])
def test_tiny_block_stays_finite(kernel_backend, amax):
    # 1e-10: d is a normal float32 but underflows to 0 as float16 (ggml: q from the float32 d).
    # 1e-38: d is a float32 subnormal and 1/d overflows; only finiteness is ggml-defined there.
    vals = np.array([amax, -amax / 2, amax / 3, 0.0], np.float32)
    qs, d = q8(block(vals), kernel_backend)
    assert d[0, 0] == 0.0
    assert qs.min() >= -127 and qs.max() <= 127
    if amax == 1e-10:
        assert qs[0, :4].tolist() == ggml_q8_0(np.array(block(vals)))[0][0, :4].tolist()
    out = np.array(dequantize_q8_0(mx.array(qs), mx.array(d), dtype=mx.float32,
                                   backend=kernel_backend))
    assert np.all(out == 0.0)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bfloat16", "float32"])
def test_huge_block_gets_a_finite_guarded_scale(kernel_backend, dtype):
    # amax / 127 >= 65520 would round to an infinite half (ggml stores inf): the scale
    # saturates at 65504 and the quants at +-127, and the block stays finite. Just below the
    # threshold (d in [65504, 65520) rounds to 65504 in half) ggml's values are kept.
    # edge: the largest magnitude below the guard each dtype represents (float32: d in the
    # [65504, 65520) sliver where half(d) is 65504; bfloat16 steps by 32768 there)
    big, edge = 1.0e9, 127.0 * 65510.0 if dtype == mx.float32 else 253.0 * 32768
    x = mx.concatenate([block([big, -big / 3, 5.0e6, 1.0], dtype), block([edge, 1.0e6], dtype),
                        block([3.0, -1.5], dtype)], axis=1)
    qs, d = q8(x, kernel_backend)
    d_edge = np.float16(np.float32(edge) / np.float32(127))
    assert d[0].tolist() == [65504.0, d_edge, np.float16(np.float32(3.0) / np.float32(127))]
    assert np.isfinite(d_edge)
    xf = np.array(x.astype(mx.float32))[0]
    assert qs[0, :4].tolist() == [127, -127, round(float(xf[2]) / 65504.0), 0]
    qs_ref, d_ref = ggml_q8_0(xf[None, 32:])
    np.testing.assert_array_equal(qs[0, 32:], qs_ref[0])  # below the guard: ggml exactly
    np.testing.assert_array_equal(d[0, 1:].view(np.uint16), d_ref[0].view(np.uint16))
    out = np.array(dequantize_q8_0(mx.array(qs), mx.array(d), dtype=mx.float32,
                                   backend=kernel_backend))
    assert np.all(np.isfinite(out)) and out[0, 0] == 127 * 65504.0
    # the reference backend takes the same guard
    qr, dr = quantize_q8_0_reference(x)
    np.testing.assert_array_equal(np.array(qr), qs)
    np.testing.assert_array_equal(np.array(dr).view(np.uint16), d.view(np.uint16))


def test_contiguous_and_strided_inputs_agree(msl_backend):
    # The kernels index a row-contiguous array directly and a view through 32-bit index math;
    # both give the same quants, also for a view whose size-1 axis has an odd stride.
    rng = np.random.default_rng(9)
    buf = mx.array(rng.standard_normal((3, 1, 4, 96)).astype(np.float32)).astype(mx.float16)
    views = {"contiguous": buf, "sliced": mx.concatenate([buf, buf], axis=2)[:, :, 2:6],
             "transposed": buf.transpose(1, 0, 2, 3)}
    want = quantize_q8_0_reference(buf)
    for name, v in views.items():
        qs, d = quantize_q8_0(v, backend=msl_backend)
        ref = quantize_q8_0_reference(mx.contiguous(v))
        assert mx.array_equal(qs, ref[0]) and mx.array_equal(d, ref[1]), name
        back = dequantize_q8_0(qs, d, dtype=mx.float32, backend=msl_backend)
        assert mx.array_equal(back, dequantize_q8_0_reference(*ref, mx.float32)), name
    assert mx.array_equal(want[0], quantize_q8_0(buf, backend=msl_backend)[0])


def test_nan_counts_as_zero_in_the_block_scale(kernel_backend):
    # One NaN must not wipe its block: amax ignores it and the NaN element quantizes to 0.
    x = block([1.0] * 5 + [float("nan"), 1.0, 4.0])
    qs, d = q8(x, kernel_backend)
    assert d[0, 0] == np.float16(np.float32(4.0) / np.float32(127.0))
    assert qs[0, 5] == 0 and qs[0, 7] == 127 and qs[0, 0] == 32


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_dequantize_matches_ggml(kernel_backend, dtype):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 96)).astype(np.float32)
    qs, d = ggml_q8_0(x)
    out = dequantize_q8_0(mx.array(qs), mx.array(d), dtype=dtype, backend=kernel_backend)
    assert out.dtype == dtype and out.shape == (3, 4, 96)
    raw = np.concatenate([d.reshape(-1, 1).view(np.uint8).reshape(-1, 2),
                          qs.reshape(-1, 32).view(np.uint8)], axis=1)
    want = quants.dequantize(raw.reshape(-1, 34), GGMLQuantizationType.Q8_0).reshape(x.shape)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)),
                                  np.array(mx.array(want).astype(dtype).astype(mx.float32)))


def test_strided_views_are_read_in_place(msl_backend):
    # A KV-cache-like buffer (B, L, H, D) seen as (B, H, L, D) and sliced along L.
    rng = np.random.default_rng(3)
    buf = mx.array(rng.standard_normal((2, 20, 3, 64)).astype(np.float32)).astype(mx.float16)
    view = buf.transpose(0, 2, 1, 3)[:, :, 3:17, :]
    qs, d = quantize_q8_0(view, backend=msl_backend)
    qs_ref, d_ref = quantize_q8_0_reference(mx.contiguous(view))
    assert mx.array_equal(qs, qs_ref) and mx.array_equal(d, d_ref)
    qbuf = mx.concatenate([qs, qs], axis=2)[:, :, 5:19, :]   # strided (qs, d) views
    dbuf = mx.concatenate([d, d], axis=2)[:, :, 5:19, :]
    out = dequantize_q8_0(qbuf, dbuf, dtype=mx.float32, backend=msl_backend)
    ref = dequantize_q8_0_reference(mx.contiguous(qbuf), mx.contiguous(dbuf), mx.float32)
    assert mx.array_equal(out, ref)


def test_kernels_really_ran(msl_backend):
    before_q = kernels.LAUNCH_COUNTS[("q8_0_quantize", msl_backend)]
    before_d = kernels.LAUNCH_COUNTS[("q8_0_dequantize", msl_backend)]
    qs, d = quantize_q8_0(block([1.0]), backend=msl_backend)
    dequantize_q8_0(qs, d, backend=msl_backend)
    assert kernels.LAUNCH_COUNTS[("q8_0_quantize", msl_backend)] == before_q + 1
    assert kernels.LAUNCH_COUNTS[("q8_0_dequantize", msl_backend)] == before_d + 1


def test_reference_round_trip_error_bound():
    # |x - q d| <= d / 2 + |q| |d - fp16(d)| <= amax / 254 + amax * 2**-11 per block.
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    qs, d = quantize_q8_0_reference(mx.array(x))
    back = np.array(dequantize_q8_0_reference(qs, d, mx.float32)).reshape(16, 8, 32)
    amax = np.abs(x.reshape(16, 8, 32)).max(-1, keepdims=True)
    assert np.all(np.abs(back - x.reshape(16, 8, 32)) <= amax * (1 / 254 + 2.0**-11))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: quantize_q8_0(np.zeros((1, 32))), TypeError, "x must be an mx.array"),
        (lambda: quantize_q8_0(mx.zeros((1, 32), mx.int32)), TypeError, "x must be float16"),
        (lambda: quantize_q8_0(mx.zeros((2, 48))), ValueError, "multiple of 32"),
        (lambda: quantize_q8_0(mx.zeros(())), ValueError, "at least 1"),
        (lambda: dequantize_q8_0(mx.zeros((1, 32), mx.int32), mx.zeros((1, 1), mx.float16)),
         TypeError, "qs must be int8"),
        (lambda: dequantize_q8_0(mx.zeros((1, 32), mx.int8), mx.zeros((1, 1), mx.float32)),
         TypeError, "d must be float16"),
        (lambda: dequantize_q8_0(mx.zeros((1, 64), mx.int8), mx.zeros((1, 1), mx.float16)),
         ValueError, r"d must have shape \(1, 2\)"),
        (lambda: dequantize_q8_0(mx.zeros((1, 32), mx.int8), mx.zeros((1, 1), mx.float16),
                                 dtype=mx.int32), TypeError, "dtype must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
