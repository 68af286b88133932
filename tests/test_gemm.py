"""Bricks 1 and 2 (``mlx_bricks.ops.linear``) against float64 numpy, on every backend.

The issue's sweep (M x N x K x dtype x bias x residual) runs in full on ``reference`` and
``metal``; on the emulator the default suite runs a covering subset (every value of each axis,
both tile variants, aligned and unaligned M/N, vector and scalar K loads, with and without a K
tail) and the rest of the cross product is marked slow. An emulator fault (out-of-bounds access,
race, unwritten output) raises, so a passing emulator test is also a clean fault report.
"""
from __future__ import annotations

import functools
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.gemm import msl as gemm
from mlx_bricks.bricks.gemm.msl import plan_gemm, select_tile
from mlx_bricks.bricks.gemm.op import linear
from tests.support import require_backend, sampled, tile_for
from tests.tolerance import assert_dtype_close, to_f64

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SWEEP_M = (1, 7, 64, 100, 257)
SWEEP_N = (8, 72, 192, 576)
SWEEP_K = (1, 9, 64, 576, 1000)

# Emulator cases of the default suite: (M, N, K, dtype, bias, residual). Every sweep value of
# each axis appears; 64x64 tiles by the rule (257 x 576), 32x32 otherwise; M/N aligned (64 x 192
# on 32x32) and not; K in 128-bit vectors (64, 576, 1000) and scalar (1, 9); with a K tail
# (1, 9, 1000) and without (64, 576).
# Besides the cover, the default suite runs about one emulator case in SAMPLE_ONE_IN of the
# sweep, a fixed hash-chosen sample (tests.support.sampled); `-m slow` runs the rest.
SAMPLE_ONE_IN = 20
EMULATOR_COVER = {
    (1, 8, 1, "float16", False, False),
    (7, 72, 9, "bfloat16", True, False),
    (64, 192, 64, "float32", False, True),
    (100, 576, 1000, "float16", True, True),
    (257, 576, 576, "bfloat16", False, True),
    (257, 192, 1000, "float32", True, False),
    (257, 576, 9, "float32", True, True),
    (64, 8, 576, "bfloat16", True, True),
}




def _sweep_params():
    for case in itertools.product(SWEEP_M, SWEEP_N, SWEEP_K, DTYPES, (False, True),
                                  (False, True)):
        for backend in ("metal", "cuda", "emulator", "reference"):
            ident = "-".join(map(str, (backend, *case)))
            slow = (backend == "emulator" and case not in EMULATOR_COVER
                    and not sampled(ident, SAMPLE_ONE_IN))
            yield pytest.param(backend, *case, marks=[pytest.mark.slow] if slow else [],
                               id=ident)


def _randn(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _operands(M, N, K, dtype, with_bias, with_residual, lead=None, seed=0):
    lead = (M,) if lead is None else lead
    x = _randn((*lead, K), dtype, seed)
    w = _randn((N, K), dtype, seed + 1, scale=1.0 / math.sqrt(K))
    b = _randn((N,), dtype, seed + 2) if with_bias else None
    r = _randn((*lead, N), dtype, seed + 3) if with_residual else None
    return x, w, b, r


def _ref64(x, w, b=None, r=None, xw64=None):
    y = to_f64(x) @ to_f64(w).T if xw64 is None else xw64
    if b is not None:
        y = y + to_f64(b)
    if r is not None:
        y = y + to_f64(r)
    return y


def _naive(x, w, b=None, r=None, xw=None):
    """The same-dtype MLX computation of the tolerance rule, written here (not linear_reference)
    so that the reference backend is checked against an independent computation too."""
    y = x @ w.T if xw is None else xw
    if b is not None:
        y = y + b
    if r is not None:
        y = y + r
    return y


def _check(out, x, w, b=None, r=None, what="", xw64=None, xw=None):
    assert out.dtype == x.dtype, f"{what}: output dtype {out.dtype} != input dtype {x.dtype}"
    assert_dtype_close(out, _ref64(x, w, b, r, xw64), _naive(x, w, b, r, xw), dtype=x.dtype,
                       what=what)


@functools.lru_cache(maxsize=4)
def _sweep_data(M, N, K, dtype):
    """Operands and both products of one (M, N, K, dtype), shared by its bias/residual cases."""
    x, w, b, r = _operands(M, N, K, DTYPES[dtype], True, True, seed=M * 7 + N * 3 + K)
    xw = x @ w.T
    mx.eval(x, w, b, r, xw)
    return x, w, b, r, to_f64(x) @ to_f64(w).T, xw


@pytest.mark.parametrize("backend,M,N,K,dtype,bias,residual", list(_sweep_params()))
def test_linear_sweep(backend, M, N, K, dtype, bias, residual):
    require_backend(backend)
    x, w, b, r, xw64, xw = _sweep_data(M, N, K, dtype)
    b = b if bias else None
    r = r if residual else None
    out = linear(x, w, b, r, backend=backend)
    _check(out, x, w, b, r, what=f"{backend} M={M} N={N} K={K} {dtype}", xw64=xw64, xw=xw)


# Variants forced through `tile=`, so both tiles meet every load/store path whatever the rule.
VARIANTS = [
    # M, N, K, dtype, tile: what it covers
    (64, 192, 64, "float16", "64x64"),     # aligned M/N, vector loads, no K tail
    (128, 64, 1000, "float32", "64x64"),   # aligned M/N, vector loads, K tail
    (65, 130, 9, "bfloat16", "64x64"),     # unaligned M/N, scalar loads, K tail
    (33, 31, 1000, "float16", "32x32"),    # unaligned, vector loads with a K tail
    (96, 64, 33, "float32", "32x32"),      # aligned M/N, scalar loads (K odd), K tail
    # single-buffered pipeline (STAGES = 1): two barriers per K step
    (64, 192, 64, "bfloat16", "64x64_sb"),  # aligned, vector loads, no K tail
    (65, 130, 9, "float16", "64x64_sb"),   # unaligned, scalar loads, K tail
    (33, 31, 1000, "float32", "32x32_sb"),  # unaligned, vector loads with a K tail
    # BK = 16 (32-row tiles: half the loader threads idle) and scheduling hints
    (64, 192, 64, "float16", "64x64_bk16"),      # aligned, vector loads
    (65, 130, 9, "bfloat16", "64x64_bk16_sb"),   # unaligned, scalar loads, K tail
    (33, 31, 1000, "float16", "32x32_bk16"),     # idle loader threads, vector loads, K tail
    (96, 64, 33, "bfloat16", "32x32_bk16_sb_sh"),  # idle loader threads, scalar loads
    (128, 64, 1000, "float32", "64x64_sh"),      # hints, vector loads, K tail
    (40, 72, 64, "float16", "32x32_sb_sh"),      # hints, single buffer
]


@pytest.mark.parametrize("M,N,K,dtype,tile", VARIANTS)
def test_linear_tile_variants(kernel_backend, M, N, K, dtype, tile):
    x, w, b, r = _operands(M, N, K, DTYPES[dtype], True, True, seed=M + N + K)
    out = linear(x, w, b, r, tile=tile_for(kernel_backend, tile), backend=kernel_backend)
    _check(out, x, w, b, r, what=f"{kernel_backend} {tile} M={M} N={N} K={K} {dtype}")


@pytest.mark.parametrize("tile", ["128x128", "128x64", "64x64", "wg128x256", "wg128x128"])
@pytest.mark.parametrize("M,N,K,dtype", [(300, 200, 136, "bfloat16"), (129, 64, 520, "float16"),
                                         (5, 257, 63, "bfloat16"), (513, 300, 1024, "bfloat16")])
def test_cuda_tiles(tile, M, N, K, dtype):
    """Every CUDA tile (mma.sync and, on sm_90, wgmma) on ragged M, N, K (full, partial and
    scalar-loaded K stages)."""
    require_backend("cuda")
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    if tile not in gemm_cuda.tile_names():
        pytest.skip(f"tile {tile} does not run on this GPU")
    x, w, b, r = _operands(M, N, K, DTYPES[dtype], True, True, seed=M + 3 * N + K)
    out = linear(x, w, b, r, tile=tile, backend="cuda")
    _check(out, x, w, b, r, what=f"cuda {tile} M={M} N={N} K={K} {dtype}")


@pytest.mark.parametrize("lead", [(2, 3, 17), (4, 16), (1, 1, 1, 5)])
def test_linear_batched_leading_dims(kernel_backend, lead):
    x, w, b, r = _operands(None, 72, 64, mx.float16, True, True, lead=lead, seed=len(lead))
    out = linear(x, w, b, r, backend=kernel_backend)
    assert tuple(out.shape) == (*lead, 72)
    _check(out, x, w, b, r, what=f"{kernel_backend} lead={lead}")


def test_linear_one_dimensional_x(kernel_backend):
    x, w, b, _ = _operands(None, 40, 24, mx.float32, True, False, lead=(), seed=5)
    out = linear(x, w, b, backend=kernel_backend)
    assert tuple(out.shape) == (40,)
    _check(out, x, w, b, what=f"{kernel_backend} 1-D x")


def _views():
    """Non-contiguous x of logical shape (..., K=64) built from larger arrays."""
    base = _randn((2, 72, 96), mx.float16, 11)
    return {
        # leading-dim slice: row strides stay multiples of 8 -> 128-bit path
        "rows_step2": base[:, ::2, :64],
        # last-dim slice: row stride 96, unit K stride
        "k_slice": base[:, 3:30, :64],
        # negative row stride, 16-byte offset
        "reversed": base[:, ::-1, 8:72],
        # K stride != 1 -> scalar strided loads
        "transposed": _randn((64, 40), mx.float16, 12).T,
        "swapped": mx.swapaxes(base[:, :64, :64], 1, 2),
        # stride 0 along a leading dim
        "broadcast": mx.broadcast_to(base[0, :5, :64], (3, 5, 64)),
        # first element 2 bytes past a 16-byte boundary: the chunk loads must not assume
        # 16-byte alignment of device data
        "odd_start": base[:, :, 1:65],
    }


@pytest.mark.parametrize("view", sorted(_views()))
def test_linear_non_contiguous_x(kernel_backend, view):
    x = _views()[view]
    assert x.shape[-1] == 64
    _, w, b, r = _operands(None, 72, 64, mx.float16, True, True, lead=tuple(x.shape[:-1]), seed=3)
    out = linear(x, w, b, r, backend=kernel_backend)
    _check(out, x, w, b, r, what=f"{kernel_backend} view={view}")


def test_linear_non_contiguous_weight_and_residual(kernel_backend):
    x = _randn((20, 48), mx.bfloat16, 8)
    w = _randn((48, 72), mx.bfloat16, 9, scale=0.1).T  # (72, 48) column-major view: copied
    r = _randn((72, 20), mx.bfloat16, 10).T
    out = linear(x, w, None, r, backend=kernel_backend)
    _check(out, x, w, None, r, what=f"{kernel_backend} strided weight/residual")


def test_linear_empty_rows(kernel_backend):
    x = mx.zeros((0, 16), dtype=mx.float32)
    w = _randn((8, 16), mx.float32, 1)
    out = linear(x, w, backend=kernel_backend)
    assert tuple(out.shape) == (0, 8) and out.dtype == mx.float32


def test_linear_launches_the_kernel(msl_backend):
    x, w, b, r = _operands(9, 16, 24, mx.float32, True, True, seed=4)
    before = kernels.LAUNCH_COUNTS[("gemm", msl_backend)]
    out = linear(x, w, b, r, backend=msl_backend)
    mx.eval(out)
    assert kernels.LAUNCH_COUNTS[("gemm", msl_backend)] == before + 1
    _check(out, x, w, b, r, what=msl_backend)


@pytest.mark.parametrize("pad_chunks", [0, 2])
def test_linear_pitch_padding(msl_backend, pad_chunks):
    x, w, b, r = _operands(40, 72, 64, mx.float16, True, True, seed=6)
    plan = plan_gemm(40, 72, 64, mx.float16, tile="64x64", pad_chunks=pad_chunks)
    assert plan.pad == 8 * pad_chunks
    out = gemm.launch_gemm(x, w, b, r, plan, msl_backend)
    _check(out, x, w, b, r, what=f"{msl_backend} pad_chunks={pad_chunks}")


# ---- launch plan: tile rule, threadgroup memory, grid ----------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("tile", sorted(gemm.TILES))
def test_threadgroup_memory_within_limit(dtype, tile):
    p = plan_gemm(100, 100, 100, dtype, tile=tile)
    t = gemm.TILES[tile]
    stages = 1 if "_sb" in tile else 2
    assert t.stages == stages and ("_sb" in t.name) == (stages == 1)
    assert p.bk == (16 if "_bk16" in tile else 64 // dtype.size) and t.sched == ("_sh" in tile)
    expected = stages * (t.bm + t.bn) * (p.bk + p.pad) * dtype.size
    assert p.threadgroup_bytes == expected <= 32 * 1024
    assert (p.pad * dtype.size) % 16 == 0 and (p.bk * dtype.size) % 16 == 0


def test_threadgroup_memory_limit_is_enforced(monkeypatch):
    with pytest.raises(RuntimeError, match="49152 bytes of threadgroup memory"):
        plan_gemm(64, 64, 64, mx.float16, tile="32x32", pad_chunks=20)
    monkeypatch.setattr(gemm, "THREADGROUP_MEMORY_LIMIT", 1024)
    with pytest.raises(RuntimeError, match="threadgroup memory"):
        plan_gemm(64, 64, 64, mx.float16)


@pytest.mark.parametrize("pad_chunks", [-1, 1.5, True])
def test_pad_chunks_must_be_a_non_negative_int(pad_chunks):
    with pytest.raises(ValueError, match="pad_chunks must be an int >= 0"):
        plan_gemm(64, 64, 64, mx.float16, pad_chunks=pad_chunks)


@pytest.mark.parametrize("M,N,tile", [
    (1, 4096, "32x32"), (4096, 32, "32x32"), (100, 576, "32x32"), (257, 576, "64x64"),
    (2048, 4096, "64x64"), (33, 33 * 64, "64x64"),
])
def test_tile_rule(M, N, tile):
    assert select_tile(M, N) == tile


@pytest.mark.parametrize("M,N,K", [(1, 8, 1), (257, 576, 1000), (64, 192, 9)])
def test_grid_is_a_multiple_of_the_threadgroup(M, N, K):
    for tile in gemm.TILES:
        p = plan_gemm(M, N, K, mx.float16, tile=tile)
        t = gemm.TILES[tile]
        assert p.grid[0] % p.threadgroup[0] == 0
        assert p.grid[0] // p.threadgroup[0] * t.bn >= N
        assert p.grid[1] * t.bm >= M
        assert p.align_mn == (M % t.bm == 0 and N % t.bn == 0)
        assert p.vec == (K % 8 == 0)


# ---- argument errors --------------------------------------------------------------------------

def _ok():
    return _randn((4, 8), mx.float16, 0), _randn((6, 8), mx.float16, 1)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_linear_errors(backend):
    x, w = _ok()
    cases = [
        (TypeError, "x must be an mx.array", lambda: linear(np.zeros((4, 8)), w, backend=backend)),
        (TypeError, "x must be float16", lambda: linear(x.astype(mx.int32), w, backend=backend)),
        (TypeError, "mixed dtypes", lambda: linear(x, w.astype(mx.float32), backend=backend)),
        (TypeError, "bias has dtype", lambda: linear(x, w, mx.zeros((6,)), backend=backend)),
        (ValueError, "weight must have 2 dimensions", lambda: linear(x, w[0], backend=backend)),
        (ValueError, r"weight must have shape \(N, K=8\)",
         lambda: linear(x, w[:, :5], backend=backend)),
        (ValueError, r"bias must have shape \(6,\)",
         lambda: linear(x, w, mx.zeros((5,), mx.float16), backend=backend)),
        (ValueError, "residual must have the output shape",
         lambda: linear(x, w, None, mx.zeros((4, 5), mx.float16), backend=backend)),
        (ValueError, "non-empty last dimension",
         lambda: linear(x[:, :0], w[:, :0], backend=backend)),
        (ValueError, "tile must be None", lambda: linear(x, w, tile="128x128", backend=backend)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
