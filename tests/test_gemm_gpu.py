"""The GEMM-family CUDA twins on the GPU, every tile (marker ``gpu``; skipped without a CUDA
GPU): the wgmma tiles (sm_90a), which the CPU emulation cannot run, the split-K variants, the
128 x 128 fused SwiGLU tile and 8-bit weights on the 128 x 256 tiles, each with float and
affine weights on ragged M / N / K, against float64 with the dtype-scaled rule (the helpers of
tests/test_gemm_cuda_emu.py). The same cases run on the CPU emulation for the mma.sync tiles.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_bricks.bricks.gemm.msl  # noqa: F401  (registers the kernel specs)
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from tests.gpu_support import gpu
from tests.quant_support import dequant, dequant64, randn, weight
from tests.tolerance import assert_dtype_close, to_f64

FORMATS = (None, (4, 64), (8, 64), (3, 32), (6, 128))


def _runs(tiles, tile, fmt, operands=1):
    if tile not in gemm_cuda.tile_names(tiles, weight_operands=operands,
                                        bits=fmt[0] if fmt else None):
        pytest.skip(f"tile {tile} does not run {fmt} weights on this GPU")


@gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("tile", list(gemm_cuda.LINEAR_TILES))
def test_gpu_linear_every_tile(tile, fmt):
    _runs(gemm_cuda.LINEAR_TILES, tile, fmt)
    for (M, N, K), dtype in (((300, 520, 640), mx.bfloat16), ((7, 136, 384), mx.float16)):
        x = randn((M, K), dtype, 1)
        w = weight(N, K, fmt, dtype, 2)
        b, r = randn((N,), dtype, 3), randn((M, N), dtype, 4)
        y = gemm_cuda.linear(x, w, b, r, tile=tile)
        ref = to_f64(x) @ dequant64(w).T + to_f64(b) + to_f64(r)
        assert_dtype_close(y, ref, x @ dequant(w).T + b + r, dtype=dtype,
                           what=f"{tile} {fmt} M{M} N{N} K{K}")


@gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("tile", list(swiglu_cuda.SWIGLU_TILES))
def test_gpu_fused_swiglu_every_tile(tile, fmt):
    _runs(swiglu_cuda.SWIGLU_TILES, tile, fmt, operands=2)
    M, N, K, dtype = 300, 264, 512, mx.bfloat16
    x = randn((M, K), dtype, 1)
    wg, wu = weight(N, K, fmt, dtype, 2), weight(N, K, fmt, dtype, 3)
    act = swiglu_cuda.swiglu(x, wg, wu, variant="fused", tile=tile)
    g64, u64 = to_f64(x) @ dequant64(wg).T, to_f64(x) @ dequant64(wu).T
    g, u = x @ dequant(wg).T, x @ dequant(wu).T
    assert_dtype_close(act, g64 / (1.0 + np.exp(-g64)) * u64, g * mx.sigmoid(g) * u,
                       dtype=dtype, what=f"fused {tile} {fmt}")
