"""The dequantize brick's CUDA twin (``mlx_bricks.bricks.dequantize.cuda``): bit-exact values.

1. On the CPU (tests/cuda_emu: the kernel body compiled against warp_emu.h, the paired-half and
   integer instructions emulated bit-exactly): every bits x group_size x scales dtype, ragged N
   and K (the 32-value runs when K % 128 != 0), output dtype conversions and unaligned words,
   against ``mx.dequantize`` on the CPU bit for bit (``fused=False``: MLX's CPU rounding) and
   against the float64 model of MLX's CUDA rounding bit for bit (``fused=True``). Default suite:
   a covering sample; the rest is slow.
2. Compile checks (nvcc, sm_90a and sm_80): no local memory.
3. On the GPU (marker ``gpu``): bit for bit against the device's own ``mx.dequantize``.
4. Argument errors.
"""
from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import cudacheck
from mlx_bricks.bricks.dequantize import cuda as dqc
from tests import cuda_emu
from tests.cuda_emu.affine import dequantize_model
from tests.gpu_support import gpu
from tests.support import sampled
from tests.tolerance import to_f64

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
NAME = {F16: "float16", BF16: "bfloat16", F32: "float32"}
needs_emu = pytest.mark.skipif(cuda_emu.toolchain() is None,
                               reason="no host C++ compiler or CUDA headers")


def _weight(N, K, bits, gs, dtype, seed):
    """mx.quantize of rows spanning magnitudes 1e-3 .. 1e3."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)) * 10.0 ** rng.uniform(-3, 3, (N, 1))
    return mx.quantize(mx.array(w.astype(np.float32)).astype(dtype), group_size=gs, bits=bits)


def _emulated(*args, offsets=None, **kwargs):
    def run(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes, grid,
            threadgroup, template=(), init_value=None):
        return cuda_emu.run_kernel(name, inputs, output_shapes, output_dtypes, grid,
                                   threadgroup, template, shared_memory, offsets=offsets)

    saved = dqc.launch
    dqc.launch = run
    try:
        out = dqc.dequantize_cuda(*args, **kwargs)
        mx.eval(out)
    finally:
        dqc.launch = saved
    return out


def _cases():
    # (N, K): K % 128 == 0 (128-value runs) and K % 128 != 0 (32-value runs), ragged N.
    shapes = ((5, 256), (33, 96), (1, 384), (7, 192))
    for bits, gs, dtype, (N, K) in itertools.product((2, 3, 4, 5, 6, 8), (32, 64, 128),
                                                     (F16, BF16, F32), shapes):
        if K % gs:
            continue
        cid = f"{bits}bit-gs{gs}-{NAME[dtype]}-N{N}-K{K}"
        yield pytest.param(bits, gs, dtype, N, K, id=cid,
                           marks=() if sampled(cid, 24) or cid in _COVERING else pytest.mark.slow)


_COVERING = {"4bit-gs64-bfloat16-N5-K256", "8bit-gs32-float16-N33-K96",
             "3bit-gs128-float32-N1-K384", "6bit-gs64-bfloat16-N7-K192",
             "2bit-gs32-float16-N5-K256", "5bit-gs32-bfloat16-N33-K96"}


@needs_emu
@pytest.mark.parametrize("bits, gs, dtype, N, K", list(_cases()))
def test_emulated_dequantize_is_bit_exact(bits, gs, dtype, N, K):
    q, s, b = _weight(N, K, bits, gs, dtype, seed=N * K + bits)
    twice = _emulated(q, s, b, bits=bits, group_size=gs, fused=False)
    np.testing.assert_array_equal(to_f64(twice), to_f64(mx.dequantize(q, s, b, group_size=gs,
                                                                       bits=bits)))
    once = _emulated(q, s, b, bits=bits, group_size=gs, fused=True)
    assert once.dtype == dtype and once.shape == (N, K)
    want = dequantize_model(np.array(q), to_f64(s), to_f64(b), bits, gs, NAME[dtype])
    np.testing.assert_array_equal(to_f64(once), want)


@needs_emu
@pytest.mark.parametrize("scales_dtype, dtype", [(F16, F32), (BF16, F16),
                                                 pytest.param(F32, BF16, marks=pytest.mark.slow)])
def test_emulated_output_dtype_is_converted_as_mlx_does(scales_dtype, dtype):
    """dtype= computes in the scales' dtype, then converts (as mx.dequantize(dtype=) does)."""
    q, s, b = _weight(9, 256, 4, 64, scales_dtype, seed=3)
    got = _emulated(q, s, b, bits=4, group_size=64, dtype=dtype, fused=False)
    assert got.dtype == dtype
    want = mx.dequantize(q, s, b, group_size=64, bits=4, dtype=dtype)
    np.testing.assert_array_equal(to_f64(got), to_f64(want))


@needs_emu
def test_emulated_unaligned_words_take_the_word_loads():
    """w starting 4 bytes past a 16-byte boundary: word loads, the same values."""
    q, s, b = _weight(6, 256, 8, 64, BF16, seed=5)
    aligned = _emulated(q, s, b, bits=8, group_size=64, fused=True)
    shifted = _emulated(q, s, b, bits=8, group_size=64, fused=True, offsets=[4, 0, 0])
    np.testing.assert_array_equal(to_f64(shifted), to_f64(aligned))


@pytest.mark.skipif(cudacheck.find_nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype, out, bits, unit, arch", [
    (BF16, BF16, 8, 128, "sm_90a"), (F16, F16, 4, 128, "sm_90a"), (F32, F32, 3, 32, "sm_80"),
    (BF16, F32, 5, 128, "sm_80"),
])
def test_dequantize_twin_compiles_without_local_memory(dtype, out, bits, unit, arch):
    tmpl = [("T", dtype), ("O", out), ("BITS", bits), ("GS", 64), ("FUSED", True),
            ("UNIT", unit)]
    res = cudacheck.compile_twin("dequantize", [(mx.uint32, 2), (dtype, 2), (dtype, 2)], [out],
                                 tmpl, arch=arch)
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack == 0, res


def test_rounding_follows_the_device():
    assert dqc.fused_rounding(BF16, (9, 0)) and dqc.fused_rounding(F16, (8, 0))
    assert not dqc.fused_rounding(BF16, (8, 6)) and dqc.fused_rounding(F32, (8, 0))
    assert dqc.run_values(4096) == 128 and dqc.run_values(96) == 32


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(bits=7, group_size=64), ValueError, "w.bits must be one of"),
    (dict(bits=4, group_size=48), ValueError, "w.group_size must be one of"),
    (dict(bits=4, group_size=64, dtype=mx.int32), TypeError, "dtype must be float16"),
])
def test_bad_arguments_are_named(kwargs, err, match):
    q, s, b = _weight(4, 128, 4, 64, F16, seed=1)
    with pytest.raises(err, match=match):
        dqc.dequantize_cuda(q, s, b, **kwargs)


def test_bad_arrays_are_named():
    q, s, b = _weight(4, 128, 4, 64, F16, seed=1)
    with pytest.raises(TypeError, match="w.w must be uint32"):
        dqc.dequantize_cuda(q.astype(mx.int32), s, b, bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"w.scales must have shape \(4, 2\)"):
        dqc.dequantize_cuda(q, s[:, :1], b, bits=4, group_size=64)
    with pytest.raises(TypeError, match="w.biases has dtype"):
        dqc.dequantize_cuda(q, s, b.astype(F32), bits=4, group_size=64)


@gpu
@pytest.mark.parametrize("bits", (2, 3, 4, 5, 6, 8))
@pytest.mark.parametrize("gs", (32, 64, 128))
@pytest.mark.parametrize("dtype", (F16, BF16, F32), ids=lambda d: NAME[d])
def test_gpu_dequantize_equals_mx_dequantize(bits, gs, dtype):
    for N, K in ((37, 4096 + 128 * (gs == 128)), (5, 3 * gs)):
        q, s, b = _weight(N, K, bits, gs, dtype, seed=bits + gs)
        got = dqc.dequantize_cuda(q, s, b, bits=bits, group_size=gs)
        want = mx.dequantize(q, s, b, group_size=gs, bits=bits)
        np.testing.assert_array_equal(to_f64(got), to_f64(want), err_msg=f"N{N} K{K}")
