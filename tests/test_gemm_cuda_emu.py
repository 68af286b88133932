"""The GEMM-family CUDA twins run on the CPU (tests/cuda_emu): the mma.sync path end to end.

``cuda_emu.emulated_launches`` routes the ops' own CUDA launches (``mlx_bricks.bricks.gemm.cuda``:
tile rule, geometry, template, chained launches) to the CUDA CPU emulation: the exact kernel
body and headers compiled by the host C++ compiler against ``warp_emu.h`` (cp.async commit
groups, ldmatrix, mma.sync m16n8k16 from the PTX fragment layouts, PRMT / LOP3 / funnel shift /
HFMA2 / HSUB2 bit-exactly), output poisoned with NaN bits.

1. The weight conversion is bit-exact: with x the identity (M = K) the GEMM returns its staged
   weight tile, which must equal T(s * q + b) rounded once (``cuda_emu.affine``), the value
   MLX's CUDA dequantize computes on sm_90, for every bits / group_size / dtype.
2. Linear, fused and split SwiGLU and RMSNorm + QKV with float and affine 2-8 bit weights,
   ragged M / N / K, bias and residual, against float64 with the dtype-scaled rule (naive:
   MLX's same-dtype computation on the CPU). A fixed sample runs by default, the rest is slow.

The wgmma tiles (sm_90a) are not emulated; they share the loaders and epilogues tested here and
are compile-checked (tests/test_cuda_compile.py) and run on the GPU (tests marked ``gpu``).
"""
from __future__ import annotations



import mlx.core as mx
import numpy as np
import pytest

import mlx_bricks.bricks.gemm.msl  # noqa: F401  (registers the kernel specs)
import mlx_bricks.bricks.swiglu.msl  # noqa: F401
import mlx_bricks.bricks.norm_qkv.msl  # noqa: F401
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from mlx_bricks.bricks.norm_qkv import cuda as qkv_cuda
from mlx_bricks.formats.affine import QuantizedWeight
from tests import cuda_emu
from tests.cuda_emu.affine import dequantize_model
from tests.quant_support import dequant, dequant64, randn, weight
from tests.support import sampled
from tests.tolerance import assert_dtype_close, to_f64

pytestmark = pytest.mark.skipif(cuda_emu.toolchain() is None,
                                reason="no host C++ compiler or CUDA headers")

F16, BF16 = mx.float16, mx.bfloat16
NAME = {F16: "float16", BF16: "bfloat16"}
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@pytest.fixture(autouse=True)
def _as_if_on_an_a100(monkeypatch):
    """mma.sync tiles only (the emulator has no wgmma): the tile rule as on sm_80."""
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))


def _emulated(fn, *args, **kwargs):
    with cuda_emu.emulated_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as names:
        out = fn(*args, **kwargs)
        mx.eval(out)
    return out, names


def _wide_weight(N, K, bits, gs, dtype, seed):
    """mx.quantize of rows whose magnitudes span 1e-3 .. 1e3 (scales and biases far apart)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)) * 10.0 ** rng.uniform(-3, 3, (N, 1))
    q, s, b = mx.quantize(mx.array(w.astype(np.float32)).astype(dtype), group_size=gs, bits=bits)
    return QuantizedWeight(q, s, b, gs, bits)


# ---------------------------------------------------------------------------------------------
# 1. the conversion, bit for bit

def _exact_cases():
    for i, (bits, dtype) in enumerate((b, d) for b in BITS for d in (F16, BF16)):
        for gs in GROUP_SIZES:
            cid = f"{NAME[dtype]}-{bits}bit-gs{gs}"
            default = gs == GROUP_SIZES[i % 3] and i % 2 == bits % 2
            yield pytest.param(bits, gs, dtype, id=cid,
                               marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("bits, gs, dtype", list(_exact_cases()))
def test_gemm_stages_weights_bit_exactly(bits, gs, dtype):
    K, N = 256, 72  # K: four 64-wide stages, so the one-ahead dequantization runs 3 times
    w = _wide_weight(N, K, bits, gs, dtype, seed=bits * gs)
    eye = mx.eye(K, dtype=dtype)
    y, names = _emulated(gemm_cuda.linear, eye, w, tile="64x64")
    assert names == ["gemm"]
    got = to_f64(y).T  # y = I @ W^T
    want = dequantize_model(np.array(w.w), to_f64(w.scales), to_f64(w.biases), bits, gs,
                            NAME[dtype], fused=True)
    np.testing.assert_array_equal(got, want)


def test_gemm_256_thread_tile_stages_8bit_bit_exactly():
    """The 128x128 tile (256 threads, two segments per thread) on 8-bit weights."""
    K, N = 128, 130
    w = _wide_weight(N, K, 8, 64, BF16, seed=8)
    y, _ = _emulated(gemm_cuda.linear, mx.eye(K, dtype=BF16), w, tile="128x128")
    want = dequantize_model(np.array(w.w), to_f64(w.scales), to_f64(w.biases), 8, 64,
                            "bfloat16")
    np.testing.assert_array_equal(to_f64(y).T, want)


def test_model_of_mx_dequantize_is_exact():
    """The models themselves: fused=False is MLX's CPU dequantize bit for bit (so the float64
    model is independent and right); fused=True differs from it only by rounding once."""
    for bits in BITS:
        for dtype in (F16, BF16, mx.float32):
            name = str(dtype).split(".")[-1]
            w = _wide_weight(16, 256, bits, 64, dtype, seed=bits)
            args = (np.array(w.w), to_f64(w.scales), to_f64(w.biases), bits, 64, name)
            np.testing.assert_array_equal(dequantize_model(*args, fused=False),
                                          to_f64(w.dequantize()), err_msg=f"{name} {bits}")
            exact = dequant64(w)  # s * q + b, exact in float64 for these
            once = dequantize_model(*args, fused=True)
            # rounded once = the nearest value of the dtype: never further than MLX's CPU value
            assert np.all(np.abs(once - exact) <= np.abs(to_f64(w.dequantize()) - exact))


# ---------------------------------------------------------------------------------------------
# 2. the twins against float64

def _check_linear(M, N, K, dtype, fmt, bias, residual, tile, seed):
    x = randn((M, K), dtype, seed)
    w = weight(N, K, fmt, dtype, seed + 1)
    b = randn((N,), dtype, seed + 2) if bias else None
    r = randn((M, N), dtype, seed + 3) if residual else None
    y, names = _emulated(gemm_cuda.linear, x, w, b, r, tile=tile)
    assert names == ["gemm"]
    ref = to_f64(x) @ dequant64(w).T
    naive = x @ dequant(w).T
    if b is not None:
        ref, naive = ref + to_f64(b), naive + b
    if r is not None:
        ref, naive = ref + to_f64(r), naive + r
    assert_dtype_close(y, ref, naive, dtype=dtype,
                       what=f"M{M} N{N} K{K} {NAME[dtype]} {fmt} {tile}")


#: Default-suite cases: the scalar-load path (K = 9), the tile rule, bias and residual, every
#: mma.sync tile; the sweep below adds a fixed hash-chosen sample (the rest is slow).
_LINEAR_COVERING = [
    (33, 200, 9, F16, None, True, True, "64x64"),
    (70, 100, 192, BF16, (4, 64), True, True, None),
    (129, 65, 256, F16, (5, 64), False, True, "128x64"),
    (100, 136, 320, BF16, (6, 32), True, False, "128x128"),
]


def _linear_id(M, N, K, dtype, fmt, bias, residual, tile):
    return f"M{M}-N{N}-K{K}-{NAME[dtype]}-{fmt}-{tile}-b{int(bias)}r{int(residual)}"


def _linear_cases():
    for case in _LINEAR_COVERING:
        yield pytest.param(*case, id=_linear_id(*case))
    shapes = [(1, 8, 64), (7, 72, 64), (70, 100, 192), (129, 65, 256), (33, 200, 9),
              (64, 64, 128), (100, 136, 320)]
    tiles = (None, "64x64", "128x64", "128x128")
    fmts = (None, (4, 64), (8, 32), (3, 128), (2, 32), (5, 64), (6, 32))
    n = 0
    for M, N, K in shapes:
        for fmt in fmts:
            if fmt is not None and K % fmt[1]:
                continue
            for dtype in (F16, BF16):
                case = (M, N, K, dtype, fmt, n % 2 == 0, n % 3 == 0, tiles[n % len(tiles)])
                n += 1
                if case in _LINEAR_COVERING:
                    continue
                cid = _linear_id(*case)
                yield pytest.param(*case, id=cid,
                                   marks=() if sampled(cid, 12) else pytest.mark.slow)


@pytest.mark.parametrize("M, N, K, dtype, fmt, bias, residual, tile", list(_linear_cases()))
def test_linear_twin_matches_float64(M, N, K, dtype, fmt, bias, residual, tile):
    _check_linear(M, N, K, dtype, fmt, bias, residual, tile, seed=M + N + K)


def test_linear_twin_unaligned_x_takes_the_scalar_path():
    """x starting 2 bytes past a 16-byte boundary (and K % 8 != 0 for the weight) runs the
    predicated scalar loads; values equal the aligned run bit for bit."""
    M, N, K, dtype = 40, 72, 128, F16
    x = randn((M, K), dtype, 3)
    w = weight(N, K, (4, 64), dtype, 4)
    aligned, _ = _emulated(gemm_cuda.linear, x, w, tile="64x64")
    calls = []

    def run(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes, grid,
            threadgroup, template=(), init_value=None):
        calls.append(name)
        return cuda_emu.run_kernel(name, inputs, output_shapes, output_dtypes, grid,
                                   threadgroup, template, shared_memory,
                                   offsets=[2] + [0] * (len(inputs) - 1))

    saved = gemm_cuda.launch
    gemm_cuda.launch = run
    try:
        shifted = gemm_cuda.linear(x, w, tile="64x64")
        mx.eval(shifted)
    finally:
        gemm_cuda.launch = saved
    assert calls == ["gemm"]
    np.testing.assert_array_equal(to_f64(shifted), to_f64(aligned))


def _swiglu_reference(x, wg, wu, bg, bu):
    g64 = to_f64(x) @ dequant64(wg).T + (to_f64(bg) if bg is not None else 0.0)
    u64 = to_f64(x) @ dequant64(wu).T + (to_f64(bu) if bu is not None else 0.0)
    silu = g64 / (1.0 + np.exp(-g64))
    g = x @ dequant(wg).T + (bg if bg is not None else 0)
    u = x @ dequant(wu).T + (bu if bu is not None else 0)
    return silu * u64, (g * mx.sigmoid(g)) * u


@pytest.mark.parametrize("variant, fmt_g, fmt_u, tile, M, N, K, dtype", [
    ("fused", None, None, "64x64", 70, 100, 128, F16),
    ("fused", (4, 64), (4, 64), "128x64", 33, 72, 256, BF16),
    ("split", (8, 32), (8, 32), "64x64", 50, 40, 96, F16),
    pytest.param("fused", (3, 32), (3, 32), "64x64", 20, 130, 192, BF16, marks=pytest.mark.slow),
    pytest.param("fused", (4, 64), (8, 64), None, 40, 64, 128, BF16, marks=pytest.mark.slow),
    pytest.param("split", (2, 128), (6, 64), "128x128", 130, 50, 256, F16,
                 marks=pytest.mark.slow),
])
def test_swiglu_twins_match_float64(variant, fmt_g, fmt_u, tile, M, N, K, dtype):
    x = randn((M, K), dtype, 1)
    wg, wu = weight(N, K, fmt_g, dtype, 2), weight(N, K, fmt_u, dtype, 3)
    bg = randn((N,), dtype, 4)
    act, names = _emulated(swiglu_cuda.swiglu, x, wg, wu, bg, None, variant=variant, tile=tile)
    fused = variant == "fused" and fmt_g == fmt_u
    assert names == (["swiglu_fused"] if fused else ["gemm", "gemm"])
    ref, naive = _swiglu_reference(x, wg, wu, bg, None)
    assert_dtype_close(act, ref, naive, dtype=dtype, what=f"{variant} {fmt_g} {fmt_u} {tile}")


@pytest.mark.parametrize("fmts, tile, dtype", [
    ((None, None, None), "64x64", F16),
    (((4, 64), (4, 64), (8, 64)), "128x64", BF16),
    pytest.param(((3, 32), (5, 32), (2, 64)), "64x64", F16, marks=pytest.mark.slow),
])
def test_rms_norm_qkv_twin_matches_float64(fmts, tile, dtype):
    B, L, K, H, Hkv, D = 2, 9, 128, 4, 2, 32
    x = randn((B, L, K), dtype, 1)
    nw = randn((K,), dtype, 2) + 1
    ws = [weight(h * D, K, f, dtype, 3 + i) for i, (h, f) in enumerate(zip((H, Hkv, Hkv), fmts))]
    bs = [randn((h * D,), dtype, 7 + i) for i, h in enumerate((H, Hkv, Hkv))]
    (q, k, v), names = _emulated(qkv_cuda.rms_norm_qkv, x, nw, 1e-5, *ws, *bs, n_heads=H,
                                 n_kv_heads=Hkv, head_dim=D, tile=tile)
    assert names == ["rms_norm_qkv"]
    h = mx.fast.rms_norm(x, nw, 1e-5)  # the twin's input (stock's kernel, same rounding)
    for out, wt, bt, heads in zip((q, k, v), ws, bs, (H, Hkv, Hkv)):
        ref = (to_f64(h).reshape(B * L, K) @ dequant64(wt).T + to_f64(bt))
        naive = h.reshape(B * L, K) @ dequant(wt).T + bt
        ref = ref.reshape(B, L, heads, D).transpose(0, 2, 1, 3)
        naive = naive.reshape(B, L, heads, D).transpose(0, 2, 1, 3)
        assert_dtype_close(out, ref, naive, dtype=dtype, what=f"qkv {fmts} {tile}")


@pytest.mark.parametrize("M, N, K, dtype, fmt, tile", [
    (70, 100, 320, F16, (4, 64), "128x128k2"),   # 5 stages: splits of 3 and 2
    (9, 40, 64, BF16, None, "128x128k2"),        # one stage: the second split is empty
    pytest.param(130, 72, 200, BF16, None, "128x128k2", marks=pytest.mark.slow),
    pytest.param(33, 136, 384, F16, (8, 128), "128x128k2", marks=pytest.mark.slow),
])
def test_split_k_linear_matches_float64(M, N, K, dtype, fmt, tile):
    """Split-K: partial sums per split (float32), then one reduce with bias and residual."""
    x = randn((M, K), dtype, 1)
    w = weight(N, K, fmt, dtype, 2)
    b, r = randn((N,), dtype, 3), randn((M, N), dtype, 4)
    y, names = _emulated(gemm_cuda.linear, x, w, b, r, tile=tile)
    assert names == ["gemm_splitk", "gemm_splitk_reduce"]
    ref = to_f64(x) @ dequant64(w).T + to_f64(b) + to_f64(r)
    naive = x @ dequant(w).T + b + r
    assert_dtype_close(y, ref, naive, dtype=dtype, what=f"split-K {tile} M{M} N{N} K{K} {fmt}")
