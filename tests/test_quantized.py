"""The GEMM brick (``ops.linear``) with MLX affine-quantized weights, on every backend.

Each case is checked twice under the dtype-scaled rule against float64 numpy of the weight
decoded from its packed bits: once with stock MLX's ``mx.quantized_matmul`` as the same-dtype
computation, once with ``x @ mx.dequantize(w).T`` (the dequantize-then-float reference). The
sweep (M x (N, K) x bits x group_size x dtype; bias and residual cycle through the four
combinations) runs in full on ``metal`` and ``cuda``; on the emulator and on ``reference`` the default suite
runs a covering subset (every bits, group size, dtype and M; bias and residual) plus a fixed
hash-chosen sample, the rest is ``slow``. An emulator fault (out-of-bounds access, race,
unwritten output) raises, so a passing emulator test is also a clean fault report.
"""
from __future__ import annotations

import itertools
import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.gemm import msl as gemm
from mlx_bricks.bricks.gemm.op import linear
from mlx_bricks.formats.affine import QuantizedWeight, as_weight, unsupported_reason
from tests.quant_support import DTYPES, dequant, dequant64, quantized, randn, unpack64, product
from tests.conftest import KERNEL_BACKENDS
from tests.support import require_backend, sampled, tile_for
from tests.tolerance import assert_dtype_close, to_f64

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SWEEP_M = (1, 7, 33, 100)
SWEEP_NK = ((72, 128), (200, 384))  # N ragged against every tile, K a multiple of 128
EPILOGUES = ((False, False), (True, False), (False, True), (True, True))  # (bias, residual)
SAMPLE_ONE_IN = 80
#: The reference backend is stock MLX's own quantized_matmul: the default suite runs the cover
#: and one case in this many of the sweep (the rest is ``slow``).
REFERENCE_SAMPLE_ONE_IN = 8

# (M, N, K, bits, group_size, dtype): every bits, group size, dtype and M, both (N, K); the
# epilogues these cases get (_epilogue) include bias and residual each on and off.
EMULATOR_COVER = {
    (1, 72, 128, 4, 32, "float16"),
    (7, 200, 384, 8, 64, "bfloat16"),
    (33, 72, 128, 2, 128, "float32"),
    (100, 200, 384, 3, 32, "bfloat16"),
    (7, 72, 128, 5, 128, "float16"),
    (1, 200, 384, 6, 64, "float32"),
}


def _epilogue(case) -> tuple[bool, bool]:
    """bias and residual of a sweep case: cycles through EPILOGUES by a stable hash."""
    return EPILOGUES[zlib.crc32(repr(case).encode()) % len(EPILOGUES)]


def _sweep_params():
    for M, (N, K), bits, gs, dtype in itertools.product(SWEEP_M, SWEEP_NK, BITS, GROUP_SIZES,
                                                        DTYPES):
        shape = (M, N, K, bits, gs, dtype)
        case = (*shape, *_epilogue(shape))
        for backend in KERNEL_BACKENDS:
            ident = "-".join(map(str, (backend, *case)))
            one_in = {"emulator": SAMPLE_ONE_IN, "reference": REFERENCE_SAMPLE_ONE_IN}
            slow = (backend in one_in and shape not in EMULATOR_COVER
                    and not sampled(ident, one_in[backend]))
            yield pytest.param(backend, *case, marks=[pytest.mark.slow] if slow else [],
                               id=ident)


def check_linear(out, x, w, b=None, r=None, what="", backend=None):
    """``out`` against float64 of the decoded weight, with quantized_matmul and the
    dequantize-then-float product as the same-dtype computations of the rule. The
    ``reference`` backend is stock MLX's quantized_matmul itself, which on the CPU sums bf16
    products in bf16 (several times the dequantize-then-matmul error): it is held to its own
    rule only."""
    assert out.dtype == x.dtype, f"{what}: output dtype {out.dtype}"
    ref64 = to_f64(x) @ dequant64(w).T
    naives = [("quantized_matmul", product(x, w))]
    if backend != "reference":
        naives.append(("dequantize", x @ dequant(w).T))
    for name, naive in naives:
        if b is not None:
            ref, naive = ref64 + to_f64(b), naive + b
        else:
            ref = ref64
        if r is not None:
            ref, naive = ref + to_f64(r), naive + r
        assert_dtype_close(out, ref, naive, dtype=x.dtype, what=f"{what} vs {name}")


def _operands(M, N, K, bits, gs, dtype, bias, residual, seed):
    dt = DTYPES[dtype]
    x = randn((M, K), dt, seed)
    w = quantized(N, K, bits, gs, dt, seed + 1)
    b = randn((N,), dt, seed + 2) if bias else None
    r = randn((M, N), dt, seed + 3) if residual else None
    return x, w, b, r


@pytest.mark.parametrize("backend,M,N,K,bits,group_size,dtype,bias,residual",
                         list(_sweep_params()))
def test_quantized_linear_sweep(backend, M, N, K, bits, group_size, dtype, bias, residual):
    require_backend(backend)
    x, w, b, r = _operands(M, N, K, bits, group_size, dtype, bias, residual,
                           seed=M + N + bits * 7 + group_size)
    out = linear(x, w, b, r, backend=backend)
    check_linear(out, x, w, b, r, backend=backend,
                 what=f"{backend} M={M} N={N} K={K} bits={bits} gs={group_size} {dtype} "
                      f"bias={bias} res={residual}")


def test_emulator_cover_is_covering():
    cols = list(zip(*EMULATOR_COVER))
    assert set(cols[0]) == set(SWEEP_M) and set(cols[3]) == set(BITS)
    assert set(cols[4]) == set(GROUP_SIZES) and set(cols[5]) == set(DTYPES)
    assert set(zip(cols[1], cols[2])) == set(SWEEP_NK)
    epilogues = list(zip(*map(_epilogue, EMULATOR_COVER)))
    assert set(epilogues[0]) == set(epilogues[1]) == {False, True}


# Tiles forced through `tile=`: the affine loader's run geometry differs per tile and dtype
# (values per thread: 16 on the 64-row fp16 tile, 8 on fp32, 8 on the 32-row tiles with half
# the threads idle for fp32).
TILE_CASES = [
    # M, N, K, bits, group_size, dtype, tile
    (64, 128, 256, 4, 64, "float16", "64x64"),    # aligned M/N, 2-word runs
    (65, 130, 128, 3, 32, "bfloat16", "64x64"),   # unaligned, 16-bit units, checked store
    (100, 72, 256, 5, 128, "float32", "64x64_sb"),  # single buffer, byte units
    (40, 96, 128, 8, 32, "float16", "32x32_sb"),  # single buffer, 32-row tile
    (33, 64, 384, 6, 64, "float32", "32x32"),     # 32-row fp32 tile: half the threads idle
]


@pytest.mark.parametrize("M,N,K,bits,group_size,dtype,tile", TILE_CASES)
def test_quantized_linear_tiles(kernel_backend, M, N, K, bits, group_size, dtype, tile):
    x, w, b, r = _operands(M, N, K, bits, group_size, dtype, True, True, seed=M + K)
    out = linear(x, w, b, r, tile=tile_for(kernel_backend, tile), backend=kernel_backend)
    check_linear(out, x, w, b, r, backend=kernel_backend,
                 what=f"{kernel_backend} {tile} bits={bits} {dtype}")


def test_quantized_linear_tiny_weights_in_constant_space(kernel_backend):
    # N = 1, K = 32, 2 bits: w has 2 words, scales and biases 1 value (constant address space).
    x, w, b, r = _operands(3, 1, 32, 2, 32, "float32", True, True, seed=1)
    assert w.w.size < 8 and w.scales.size < 8
    out = linear(x, w, b, r, backend=kernel_backend)
    check_linear(out, x, w, b, r, backend=kernel_backend, what=f"{kernel_backend} tiny")


def test_quantized_linear_views_and_leading_dims(kernel_backend):
    base = randn((2, 9, 160), mx.float16, 5)
    x = base[:, 1:8, 16:144]  # (2, 7, 128) strided view, read in place
    w = quantized(40, 128, 4, 64, mx.float16, 6)
    out = linear(x, w, backend=kernel_backend)
    assert tuple(out.shape) == (2, 7, 40)
    check_linear(out.reshape(14, 40), mx.contiguous(x).reshape(14, 128), w,
                 backend=kernel_backend, what=f"{kernel_backend} view")


def test_quantized_linear_takes_nn_quantized_linear(kernel_backend):
    layer = nn.QuantizedLinear(128, 48, bias=True, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    x = randn((5, 128), mx.bfloat16, 7)
    out = linear(x, layer, backend=kernel_backend)
    w = as_weight(layer)
    check_linear(out, x, w, backend=kernel_backend, what=f"{kernel_backend} nn.QuantizedLinear")
    # the module's own forward (its bias included) is the same product plus its bias
    assert_dtype_close(out + layer.bias, to_f64(x) @ dequant64(w).T + to_f64(layer.bias),
                       layer(x), dtype=mx.bfloat16, what="layer(x)")


def test_quantized_linear_launches_the_gemm_kernel(msl_backend):
    x, w, b, r = _operands(9, 40, 64, 4, 32, "float32", True, True, seed=4)
    before = kernels.LAUNCH_COUNTS[("gemm", msl_backend)]
    out = linear(x, w, b, r, backend=msl_backend)
    mx.eval(out)
    assert kernels.LAUNCH_COUNTS[("gemm", msl_backend)] == before + 1
    check_linear(out, x, w, b, r, what=msl_backend)


# ---- the format itself ----------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
def test_unpack_matches_mx_dequantize(bits):
    """The tests' own decoding of the bit stream agrees with MLX (so the float64 references
    rest on the layout MLX writes)."""
    w = quantized(6, 256, bits, 32, mx.float32, bits)
    assert unpack64(w).max() == 2**bits - 1 or bits >= 6
    np.testing.assert_allclose(dequant64(w), to_f64(w.dequantize()), rtol=2**-22, atol=1e-7)


@pytest.mark.parametrize("tile", sorted(gemm.TILES))
@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_quantized_plan_memory_and_group_size(tile, dtype):
    for gs in GROUP_SIZES:
        p = gemm.plan_gemm(100, 100, 256, dtype, tile=tile, group_size=gs)
        assert gs % p.bk == 0
        assert p.threadgroup_bytes == gemm.plan_gemm(100, 100, 256, dtype, tile=tile) \
            .threadgroup_bytes <= 32 * 1024


# ---- argument errors ------------------------------------------------------------------------

def _q(bits=4, gs=32, N=6, K=64, dtype=mx.float16, seed=0):
    return quantized(N, K, bits, gs, dtype, seed)


def _bad_weights():
    q = _q()
    return [
        (ValueError, "weight.mode must be 'affine'", QuantizedWeight(q.w, q.scales, q.biases, 32,
                                                                      4, "mxfp4")),
        (ValueError, r"weight.bits must be one of \(2, 3, 4, 5, 6, 8\), got 7",
         QuantizedWeight(q.w, q.scales, q.biases, 32, 7)),
        (ValueError, r"weight.group_size must be one of \(32, 64, 128\), got 16",
         QuantizedWeight(q.w, q.scales, q.biases, 16, 4)),
        (TypeError, "weight.bits must be an int", QuantizedWeight(q.w, q.scales, q.biases, 32,
                                                                   4.0)),
        (TypeError, "weight.w must be uint32", QuantizedWeight(q.w.astype(mx.int32), q.scales,
                                                               q.biases, 32, 4)),
        (ValueError, r"weight.w has 4 words per row, i.e. K=32 at 4 bits; expected K=64",
         QuantizedWeight(q.w[:, :4], q.scales[:, :1], q.biases[:, :1], 32, 4)),
        (ValueError, "weight.group_size 128 must divide K=64",
         QuantizedWeight(q.w, q.scales[:, :0], q.biases[:, :0], 128, 4)),
        (ValueError, r"weight.scales must have shape \(6, 2\)",
         QuantizedWeight(q.w, q.scales[:, :1], q.biases, 32, 4)),
        (ValueError, r"weight.biases must have shape \(6, 2\)",
         QuantizedWeight(q.w, q.scales, q.biases[:5], 32, 4)),
        (TypeError, "weight.biases has dtype float32 but weight.scales has float16",
         QuantizedWeight(q.w, q.scales, q.biases.astype(mx.float32), 32, 4)),
        (TypeError, "weight.scales must be float16, bfloat16 or float32",
         QuantizedWeight(q.w, q.scales.astype(mx.int32), q.biases.astype(mx.int32), 32, 4)),
        (ValueError, "weight.biases is missing", QuantizedWeight(q.w, q.scales, None, 32, 4)),
        (TypeError, "weight.scales has dtype float16 but x has float32",
         _q(dtype=mx.float16)),
        (TypeError, "weight must be an mx.array, a QuantizedWeight or an nn.QuantizedLinear",
         (q.w, q.scales, q.biases)),
    ]


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_quantized_linear_errors(backend):
    require_backend(backend)
    x16, x32 = randn((4, 64), mx.float16, 0), randn((4, 64), mx.float32, 0)
    for exc, match, w in _bad_weights():
        x = x32 if "but x has float32" in match else x16
        with pytest.raises(exc, match=match):
            linear(x, w, backend=backend)


def test_unsupported_reason():
    q = _q()
    assert unsupported_reason(q, mx.float16) is None
    assert "bfloat16" in unsupported_reason(q, mx.bfloat16)
    assert "mxfp4" in unsupported_reason(QuantizedWeight(q.w, q.scales, q.biases, 32, 4, "mxfp4"))
    layer = nn.QuantizedLinear(64, 8, group_size=32, bits=4, mode="mxfp4")
    assert "affine" in unsupported_reason(layer)
