"""The register-dequantizing GEMM kernels (``cuda_src/qgemm*.cu``, ``ws`` tiles) on the CPU
emulation (tests/cuda_emu): the mma.sync consumer end to end, with the warp-specialized pipeline
(producer warpgroup, cp.async + mbarrier ring, slot reuse), the in-register conversion and the
shared-memory epilogue that the sm_90a wgmma consumer shares.

1. The conversion is bit-exact: with x the identity (M = K) the GEMM returns the weights its
   A fragments held, which must equal T(s * q + b) rounded once (``cuda_emu.affine``) for 4 / 8
   bits, group 32 / 64 / 128, fp16 / bf16. K = 384 is six stages: the 4-deep ring of an sm_86's
   99 KB wraps, so every slot is emptied and refilled.
2. Linear (bias, residual) and fused SwiGLU (SiLU, GELU-tanh, gate / up biases) on ragged M / N
   / K against float64 with the dtype-scaled rule; unaligned activations (the producer's plain
   load path) give the aligned result bit for bit.

The wgmma consumer (sm_90a) is compile-checked (tests/test_qgemm_compile.py) and run on the GPU
(tests/test_gemm_gpu.py, every ``LINEAR_TILES`` / ``SWIGLU_TILES`` entry).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_bricks.bricks.gemm.msl  # noqa: F401  (registers the kernel specs)
from mlx_bricks import cudacheck
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from tests import cuda_emu
from tests.cuda_emu.affine import dequantize_model
from tests.quant_support import dequant, dequant64, randn, weight
from tests.test_gemm_cuda_emu import _emulated, _wide_weight
from tests.tolerance import assert_dtype_close, to_f64

pytestmark = pytest.mark.skipif(cuda_emu.toolchain() is None,
                                reason="no host C++ compiler or CUDA headers")

F16, BF16 = mx.float16, mx.bfloat16
NAME = {F16: "float16", BF16: "bfloat16"}
LINEAR_TILE, SWIGLU_TILE = "qmma128x128", "qmma128x64"


@pytest.fixture(autouse=True)
def _as_if_on_an_sm86(monkeypatch):
    """mma.sync only (no wgmma in the emulator), 99 KB of shared memory: a 4-stage ring."""
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 6))


def test_ring_wraps_on_the_emulated_device():
    assert gemm_cuda.ws_plan(gemm_cuda.LINEAR_TILES[LINEAR_TILE], 4)[0] == 4
    assert gemm_cuda.ws_plan(gemm_cuda.LINEAR_TILES[LINEAR_TILE], 8)[0] == 4


def _exact_cases():
    default = {(4, 64, BF16), (8, 32, F16), (4, 128, F16), (8, 128, BF16)}
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for dtype in (F16, BF16):
                yield pytest.param(bits, gs, dtype, id=f"{NAME[dtype]}-{bits}bit-gs{gs}",
                                   marks=() if (bits, gs, dtype) in default else pytest.mark.slow)


@pytest.mark.parametrize("bits, gs, dtype", list(_exact_cases()))
def test_qgemm_dequantizes_in_registers_bit_exactly(bits, gs, dtype):
    K, N = 384, 136  # N: a full 128-row block and a ragged one
    w = _wide_weight(N, K, bits, gs, dtype, seed=bits * gs)
    y, names = _emulated(gemm_cuda.linear, mx.eye(K, dtype=dtype), w, tile=LINEAR_TILE)
    assert names == ["qgemm"]
    want = dequantize_model(np.array(w.w), to_f64(w.scales), to_f64(w.biases), bits, gs,
                            NAME[dtype], fused=True)
    np.testing.assert_array_equal(to_f64(y).T, want)


LINEAR_CASES = [
    # (M, N, K, dtype, (bits, group_size), bias, residual)
    (70, 200, 320, BF16, (4, 32), True, True),
    (130, 72, 384, F16, (8, 128), False, True),
    pytest.param(5, 136, 448, BF16, (8, 64), True, False, marks=pytest.mark.slow),
    pytest.param(257, 264, 256, F16, (4, 64), False, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("M, N, K, dtype, fmt, bias, residual", LINEAR_CASES)
def test_qgemm_linear_matches_float64(M, N, K, dtype, fmt, bias, residual):
    x = randn((M, K), dtype, 1)
    w = weight(N, K, fmt, dtype, 2)
    b = randn((N,), dtype, 3) if bias else None
    r = randn((M, N), dtype, 4) if residual else None
    y, names = _emulated(gemm_cuda.linear, x, w, b, r, tile=LINEAR_TILE)
    assert names == ["qgemm"]
    ref, naive = to_f64(x) @ dequant64(w).T, x @ dequant(w).T
    if b is not None:
        ref, naive = ref + to_f64(b), naive + b
    if r is not None:
        ref, naive = ref + to_f64(r), naive + r
    assert_dtype_close(y, ref, naive, dtype=dtype, what=f"M{M} N{N} K{K} {fmt}")


def test_qgemm_unaligned_activations_match_the_aligned_run():
    """x two bytes past a 16-byte boundary: the producer's plain-load path, same bits."""
    M, N, K, dtype = 40, 136, 320, BF16
    x, w = randn((M, K), dtype, 5), weight(N, K, (4, 64), dtype, 6)
    r = randn((M, N), dtype, 7)
    with cudacheck.recorded_launches(gemm_cuda) as rec:
        gemm_cuda.linear(x, w, None, r, tile=LINEAR_TILE)
    (launch,) = rec
    ins = [x, w.w, w.scales, w.biases, w.scales, r]

    def run(offsets):
        (y,) = cuda_emu.run_kernel("qgemm", ins, launch.output_shapes, launch.output_dtypes,
                                   launch.grid, launch.threadgroup, launch.template,
                                   launch.shared_memory, offsets=offsets)
        return np.array(y.view(mx.uint16))

    aligned, shifted = run(None), run([2, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(shifted, aligned)
    ref = to_f64(x) @ dequant64(w).T + to_f64(r)
    assert_dtype_close(mx.array(aligned).view(dtype), ref, x @ dequant(w).T + r, dtype=dtype,
                       what="aligned x")


SWIGLU_CASES = [
    # (M, N, K, dtype, fmt, b_gate, b_up, act)
    (70, 200, 320, BF16, (4, 64), True, True, 0),
    (33, 72, 384, F16, (8, 32), False, True, 1),
    pytest.param(129, 136, 256, BF16, (8, 128), True, False, 0, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("M, N, K, dtype, fmt, bias_g, bias_u, act", SWIGLU_CASES)
def test_qgemm_swiglu_matches_float64(M, N, K, dtype, fmt, bias_g, bias_u, act):
    x = randn((M, K), dtype, 1)
    wg, wu = weight(N, K, fmt, dtype, 2), weight(N, K, fmt, dtype, 3)
    bg = randn((N,), dtype, 4) if bias_g else None
    bu = randn((N,), dtype, 5) if bias_u else None
    out, names = _emulated(swiglu_cuda.swiglu, x, wg, wu, bg, bu, tile=SWIGLU_TILE, act=act)
    assert names == ["qgemm_swiglu"]
    g64, u64 = to_f64(x) @ dequant64(wg).T, to_f64(x) @ dequant64(wu).T
    g, u = x @ dequant(wg).T, x @ dequant(wu).T
    if bg is not None:
        g64, g = g64 + to_f64(bg), g + bg
    if bu is not None:
        u64, u = u64 + to_f64(bu), u + bu
    if act == 0:
        ref, naive = g64 / (1.0 + np.exp(-g64)) * u64, g * mx.sigmoid(g) * u
    else:
        c = np.sqrt(2.0 / np.pi)
        ref = 0.5 * g64 * (1.0 + np.tanh(c * (g64 + 0.044715 * g64 ** 3))) * u64
        naive = nn.gelu_approx(g) * u
    assert_dtype_close(out, ref, naive, dtype=dtype, what=f"swiglu {fmt} act {act}")


@pytest.mark.parametrize("fmt", [None, (3, 64), (2, 32), (6, 128)], ids=str)
def test_ws_tiles_take_4_and_8_bit_affine_weights_only(fmt):
    x = mx.zeros((8, 256), dtype=BF16)
    w = weight(64, 256, fmt, BF16, 1)
    with pytest.raises(ValueError, match="-bit affine weights"):
        gemm_cuda.linear(x, w, tile=LINEAR_TILE)
    assert LINEAR_TILE not in gemm_cuda.tile_names(gemm_cuda.LINEAR_TILES,
                                                    bits=fmt[0] if fmt else None)


def test_ws_tiles_are_listed_per_device_and_never_chosen_by_the_rule():
    tiles = gemm_cuda.LINEAR_TILES
    sm86 = gemm_cuda.tile_names(tiles, cc=(8, 6), bits=4)
    sm90 = gemm_cuda.tile_names(tiles, cc=(9, 0), bits=8)
    assert LINEAR_TILE in sm86 and not any(tiles[n].wgmma for n in sm86)
    assert {n for n in gemm_cuda.WS_TILES} <= set(sm90)
    for M in (64, 2048, 8192):
        assert not tiles[gemm_cuda.select_tile(M, 4096, bits=4, cc=(9, 0))].ws
        assert not swiglu_cuda.SWIGLU_TILES[gemm_cuda.select_tile(
            M, 14336, swiglu_cuda.SWIGLU_TILES, 2, 4, cc=(9, 0))].ws


def test_swiglu_mlp_lists_and_runs_the_register_variants():
    """The tuner's ``qfused_<tile>`` variants of the MLP kind: listed for 4/8-bit gate and up
    of one format, and run as the fused ws SwiGLU then the paired ws down projection."""
    from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP

    M, N, K, dtype = 20, 160, 192, BF16  # N: 2.5 act tiles of 64
    args = dict(x=randn((M, K), dtype, 1), w_gate=weight(N, K, (4, 64), dtype, 2),
                w_up=weight(N, K, (4, 64), dtype, 3), w_down=weight(K, N, (8, 32), dtype, 4),
                residual=randn((M, K), dtype, 5))
    names = SWIGLU_MLP.listing("cuda", dtype, args)
    assert "qfused_qmma128x64" in names and not any("qwg" in n for n in names)
    other = dict(args, w_up=weight(N, K, (3, 64), dtype, 3))
    assert not any(n.startswith("qfused_") for n in SWIGLU_MLP.listing("cuda", dtype, other))
    kwargs = SWIGLU_MLP.variant_kwargs("qfused_qmma128x64")
    y, launched = _emulated(SWIGLU_MLP.brick, args, "cuda", **kwargs)
    assert launched == ["qgemm_swiglu", "qgemm"]
    g, u = (to_f64(args["x"]) @ dequant64(args[k]).T for k in ("w_gate", "w_up"))
    act = mx.array((g / (1.0 + np.exp(-g)) * u).astype(np.float32)).astype(dtype)
    ref = to_f64(act) @ dequant64(args["w_down"]).T + to_f64(args["residual"])
    naive = act @ dequant(args["w_down"]).T + args["residual"]
    assert_dtype_close(y, ref, naive, dtype=dtype, what="qfused MLP")
