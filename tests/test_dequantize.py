"""The dequantize brick (``ops.dequantize``): bit-exact against ``mx.dequantize`` on every
backend, for every bits / group_size / scales dtype / output dtype, ragged N and K (the flat
stream's short last run), views, and inputs small enough for MLX's constant address space;
``fused=True`` against the float64 value rounded once.

The covering cases run on every backend in the default suite (each bits x group_size once,
each scales dtype x output dtype pair twice); the full sweep runs on the GPU backends, and on
the CPU backends as a fixed hash-chosen sample (the rest is ``slow``).
"""
from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks import ops
from mlx_bricks.bricks.dequantize.msl import RUN_VALUES
from tests.conftest import KERNEL_BACKENDS
from tests.quant_support import dequant64, quantized, unpack64
from tests.support import require_backend, sampled

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
CPU_BACKENDS = ("emulator", "reference")
SAMPLE_ONE_IN = 8


def _shape(bits, gs, i):
    """(N, K) with K a multiple of gs; over i = 0, 1, 2 (the group sizes of one bits in COVER)
    N * K both ends in a short run (the tail path: runs of 64 or 128 values) and spans whole
    ones."""
    return ((3, gs), (5, 3 * gs), (7, 2 * gs))[i % 3]


def _check(backend, bits, gs, T, O, N, K, seed, view=False):
    q = quantized(N + 2 * view, K, bits, gs, T, seed)
    w, s, b = q.w, q.scales, q.biases
    if view:  # a row slice (bound at a byte offset) of a larger weight
        w, s, b = w[1:-1], s[1:-1], b[1:-1]
    want = mx.dequantize(w, s, b, group_size=gs, bits=bits, dtype=O)
    got = ops.dequantize(w, s, b, group_size=gs, bits=bits, dtype=O, backend=backend)
    what = f"{backend} bits={bits} gs={gs} {NAMES[T]}->{NAMES[O]} N={N} K={K} view={view}"
    assert got.dtype == O and tuple(got.shape) == (N, K), what
    assert mx.array_equal(got, want).item(), (
        what + f": max |diff| {mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()}")


COVER = [(bits, gs, DTYPES[i % 3], DTYPES[(i // 3) % 3], *_shape(bits, gs, i))
         for i, (bits, gs) in enumerate(itertools.product(BITS, GROUP_SIZES))]


@pytest.mark.parametrize("bits,gs,T,O,N,K", COVER)
def test_bit_exact(kernel_backend, bits, gs, T, O, N, K):
    before = kernels.LAUNCH_COUNTS[("dequantize", kernel_backend)]
    _check(kernel_backend, bits, gs, T, O, N, K, seed=bits * gs + N)
    if kernel_backend in kernels.MSL_BACKENDS:  # the kernel ran, not a fallback
        assert kernels.LAUNCH_COUNTS[("dequantize", kernel_backend)] == before + 1


def test_covering_cases_reach_every_path():
    """Every (scales dtype, output dtype) pair, full runs and a short last run per bits."""
    assert {(T, O) for _, _, T, O, _, _ in COVER} == set(itertools.product(DTYPES, DTYPES))
    for bits in BITS:
        sizes = [N * K for b, _, _, _, N, K in COVER if b == bits]
        # runs of 32 values never end short: N * K is a multiple of 32
        assert RUN_VALUES[bits] == 32 or any(n % RUN_VALUES[bits] for n in sizes), bits
        assert any(n >= RUN_VALUES[bits] for n in sizes), bits


def _sweep():
    for backend in KERNEL_BACKENDS:
        for i, (bits, gs, T, O) in enumerate(itertools.product(BITS, GROUP_SIZES, DTYPES,
                                                               DTYPES)):
            ident = f"{backend}-q{bits}g{gs}-{NAMES[T]}-{NAMES[O]}"
            slow = backend in CPU_BACKENDS and not sampled(ident, SAMPLE_ONE_IN)
            yield pytest.param(backend, bits, gs, T, O, *_shape(bits, gs, i + 1), id=ident,
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("backend,bits,gs,T,O,N,K", list(_sweep()))
def test_bit_exact_sweep(backend, bits, gs, T, O, N, K):
    require_backend(backend)
    _check(backend, bits, gs, T, O, N, K, seed=7 * bits + gs)


@pytest.mark.parametrize("bits,gs,N,K", [(4, 32, 1, 32), (3, 32, 1, 32), (8, 32, 1, 32),
                                         (2, 64, 1, 64), (6, 32, 1, 32)])
def test_tiny_inputs_in_the_constant_address_space(kernel_backend, bits, gs, N, K):
    """Fewer than 8 words of w, or of scales: MLX passes them as constant, not device, data."""
    _check(kernel_backend, bits, gs, mx.float16, mx.float32, N, K, seed=3)


@pytest.mark.parametrize("bits,gs,T", [(4, 64, mx.float16), (3, 32, mx.bfloat16),
                                       (5, 128, mx.float32), (8, 32, mx.bfloat16)])
def test_views(kernel_backend, bits, gs, T):
    """A row slice of a larger weight starts at any word: the 128-bit run loads have uint
    alignment only."""
    _check(kernel_backend, bits, gs, T, T, 5, 2 * gs, seed=11, view=True)


@pytest.mark.parametrize("bits,gs,T", [(4, 64, mx.float16), (8, 32, mx.bfloat16),
                                       (3, 128, mx.float32), (6, 64, mx.float16),
                                       (2, 32, mx.bfloat16), (5, 64, mx.float32)])
def test_fused_rounds_once(msl_backend, bits, gs, T):
    """``fused=True``: T(s q + b) rounded once (the float64 value rounded to T); False: the
    product and the sum each rounded."""
    q = quantized(6, 4 * gs, bits, gs, T, seed=bits)
    exact = dequant64(q)
    once = mx.array(exact).astype(T) if T != mx.float32 else mx.array(exact.astype(np.float32))
    got = ops.dequantize(q.w, q.scales, q.biases, group_size=gs, bits=bits, fused=True,
                         backend=msl_backend)
    assert mx.array_equal(got, once).item()
    two = ops.dequantize(q.w, q.scales, q.biases, group_size=gs, bits=bits, fused=False,
                         backend=msl_backend)
    with mx.stream(mx.cpu):  # MLX's CPU arithmetic in T rounds the product and the sum
        expected = (mx.repeat(q.scales, gs, axis=1) * mx.array(unpack64(q)).astype(T)
                    + mx.repeat(q.biases, gs, axis=1))
    assert mx.array_equal(two, expected).item()


def test_default_rounding_is_the_devices():
    """fused=None follows mx.dequantize on the default device (the probe); on MLX 0.32.4's CPU
    that is two roundings."""
    from mlx_bricks.bricks.dequantize.op import stock_rounds_once

    if mx.default_device() == mx.cpu:
        assert not any(stock_rounds_once(t) for t in DTYPES)


def test_empty_and_errors():
    q = quantized(4, 64, 4, 32, mx.float16, seed=0)
    w, s, b = q.w, q.scales, q.biases
    out = ops.dequantize(w[:0], s[:0], b[:0], group_size=32, bits=4, backend="reference")
    assert out.shape == (0, 64)
    with pytest.raises(ValueError, match="w.bits must be one of"):
        ops.dequantize(w, s, b, group_size=32, bits=7)
    with pytest.raises(ValueError, match="w.group_size must be one of"):
        ops.dequantize(w, s, b, group_size=16, bits=4)
    with pytest.raises(TypeError, match="w.bits must be an int"):
        ops.dequantize(w, s, b, group_size=32, bits=4.0)
    with pytest.raises(ValueError, match=r"w.scales must have shape \(4, 2\)"):
        ops.dequantize(w, s[:, :1], b, group_size=32, bits=4)
    with pytest.raises(TypeError, match="w.w must be uint32"):
        ops.dequantize(w.astype(mx.int32), s, b, group_size=32, bits=4)
    with pytest.raises(TypeError, match="w.biases has dtype float32"):
        ops.dequantize(w, s, b.astype(mx.float32), group_size=32, bits=4)
    with pytest.raises(TypeError, match="dtype must be None, float16, bfloat16 or float32"):
        ops.dequantize(w, s, b, group_size=32, bits=4, dtype=mx.int8)
    with pytest.raises(TypeError, match="fused must be None or a bool"):
        ops.dequantize(w, s, b, group_size=32, bits=4, fused=1)
    with pytest.raises(ValueError, match="unknown backend"):
        ops.dequantize(w, s, b, group_size=32, bits=4, backend="vulkan")


def test_cuda_backend_launches_the_twin():
    """On ``cuda`` the op runs the brick's CUDA twin (launch recorded: no GPU here)."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.dequantize import cuda
    from mlx_bricks.bricks.dequantize.op import has_kernel

    q = quantized(4, 64, 4, 32, mx.float16, seed=0)
    assert has_kernel("cuda") and has_kernel("emulator") and not has_kernel("reference")
    with cudacheck.recorded_launches(cuda) as rec:
        out = cuda.run(q, mx.float16, None)
    assert [r.name for r in rec] == ["dequantize"] and out.shape == (4, 64)
