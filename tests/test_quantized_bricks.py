"""SwiGLU (fused and split) and RMSNorm + QKV with MLX affine-quantized weights, every backend.

References: float64 numpy of the weights decoded from their packed bits; the same-dtype
computation of the tolerance rule is stock MLX's (``mx.quantized_matmul`` for every quantized
projection, as ``nn.QuantizedLinear`` runs it). Gate, up and down, and q, k and v, each have
their own format (float or bits/group_size), as mlx-lm's mixed-bits recipes make them. The
listed covering cases run on every backend; the sweeps (variant/format x bits x group_size x
dtype) run in full on the GPU backends and, on the emulator and ``reference``, as a fixed
hash-chosen sample in the default suite (the rest is ``slow``).
"""
from __future__ import annotations

import itertools
import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.norm_qkv.op import rms_norm_qkv
from mlx_bricks.bricks.swiglu.op import swiglu, swiglu_mlp
from mlx_bricks.formats.affine import QuantizedWeight
from tests.quant_support import DTYPES, dequant64, product, randn, weight
from tests.conftest import KERNEL_BACKENDS
from tests.support import require_backend, sampled, tile_for
from tests.tolerance import assert_dtype_close, to_f64

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
SAMPLE_ONE_IN = 48
#: Backends that run on the CPU here: the sweeps' default-suite sample applies to them; the GPU
#: backends (metal, cuda) run every case.
CPU_BACKENDS = ("emulator", "reference")
EPS = 1e-5


def _pick(seq, *key):
    return seq[zlib.crc32(repr(key).encode()) % len(seq)]


# ---- SwiGLU ---------------------------------------------------------------------------------

def _silu64(g):
    e = np.exp(-np.abs(g))
    return np.where(g >= 0, g / (1.0 + e), g * e / (1.0 + e))


def run_swiglu_case(backend, variant, M, K, N, fmts, dtype, bias, residual, tile=None):
    """fmts: (gate, up, down) formats, each None (float) or (bits, group_size). Without a
    residual the case checks ``swiglu``'s act, with one ``swiglu_mlp`` end to end."""
    dt = DTYPES[dtype]
    s = M + K + N + sum(map(hash, fmts)) % 97
    x = randn((M, K), dt, s)
    wg, wu = weight(N, K, fmts[0], dt, s + 1), weight(N, K, fmts[1], dt, s + 2)
    bg, bu = (randn((N,), dt, s + 3), randn((N,), dt, s + 4)) if bias else (None, None)
    g64, u64 = to_f64(x) @ dequant64(wg).T, to_f64(x) @ dequant64(wu).T
    g, u = product(x, wg), product(x, wu)
    if bias:
        g64, u64, g, u = g64 + to_f64(bg), u64 + to_f64(bu), g + bg, u + bu
    act64, act = _silu64(g64) * u64, nn.silu(g) * u
    what = f"{backend} {variant} {tile} M={M} K={K} N={N} {fmts} {dtype} bias={bias}"
    if not residual:
        out = swiglu(x, wg, wu, b_gate=bg, b_up=bu, variant=variant, tile=tile, backend=backend)
        assert out.dtype == dt and tuple(out.shape) == (M, N), what
        assert_dtype_close(out, act64, act, dtype=dt, what=what)
        return
    wd = weight(K, N, fmts[2], dt, s + 5)
    r = randn((M, K), dt, s + 6)
    out = swiglu_mlp(x, wg, wu, wd, r, b_gate=bg, b_up=bu, variant=variant, backend=backend)
    assert out.dtype == dt and tuple(out.shape) == (M, K), what
    assert_dtype_close(out, act64 @ dequant64(wd).T + to_f64(r), product(act, wd) + r,
                       dtype=dt, what=what)


Q4, Q8 = (4, 64), (8, 32)
# variant, M, K, N_mlp, (gate, up, down) formats, dtype, bias, residual
SWIGLU_COVER = [
    ("fused", 7, 128, 96, (Q4, Q4, Q8), "float16", True, True),
    ("split", 33, 256, 128, ((3, 32), (3, 32), (6, 128)), "bfloat16", False, True),
    ("fused", 1, 128, 200, ((6, 128), (6, 128), None), "float32", True, False),
    (None, 7, 128, 64, (Q4, Q8, (2, 32)), "bfloat16", False, True),  # mixed: runs split
    ("split", 5, 64, 40, (None, (5, 64), None), "float16", True, False),  # float gate
]
# Tiles forced: the fused 64x64 weight tile has 128 rows (32-value runs), the fused 32x16 one 32
# rows (fp32: half the threads idle); single buffer.
SWIGLU_TILES = [
    ("fused", "64x64", 70, 128, 130, (Q8, Q8, None), "float16"),
    ("fused", "32x16_sb", 33, 128, 40, ((5, 32), (5, 32), None), "float32"),
    ("split", "64x64_sb", 65, 256, 72, ((2, 128), (2, 128), None), "bfloat16"),
    # BK = 16: 8-value runs on 16-wide K steps, 32-row x tile with idle loader threads
    ("fused", "32x16_bk16_sh", 33, 128, 40, ((4, 32), (4, 32), None), "float16"),
]


def _swiglu_sweep():
    for variant, bits, gs, dtype in itertools.product(("fused", "split"), BITS, GROUP_SIZES,
                                                      DTYPES):
        key = (variant, bits, gs, dtype)
        M, K, N = _pick(((1, 128, 72), (7, 256, 128), (33, 384, 256)), *key)
        bias, residual = _pick(((False, False), (True, False), (False, True), (True, True)),
                               *key, "epilogue")
        down = _pick((None, (bits, gs), Q8), *key, "down")
        if down is not None and N % down[1]:
            down = None  # the down projection's K (= N_mlp) must be a multiple of its group
        case = (variant, M, K, N, ((bits, gs), (bits, gs), down), dtype, bias, residual)
        for backend in KERNEL_BACKENDS:
            ident = "-".join(map(str, (backend, *key)))
            slow = backend in CPU_BACKENDS and not sampled(ident, SAMPLE_ONE_IN)
            yield pytest.param(backend, *case, id=ident,
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("variant,M,K,N,fmts,dtype,bias,residual", SWIGLU_COVER)
def test_quantized_swiglu(kernel_backend, variant, M, K, N, fmts, dtype, bias, residual):
    run_swiglu_case(kernel_backend, variant, M, K, N, fmts, dtype, bias, residual)


@pytest.mark.parametrize("variant,tile,M,K,N,fmts,dtype", SWIGLU_TILES)
def test_quantized_swiglu_tiles(kernel_backend, variant, tile, M, K, N, fmts, dtype):
    run_swiglu_case(kernel_backend, variant, M, K, N, fmts, dtype, True, False,
                    tile=tile_for(kernel_backend, tile))


@pytest.mark.parametrize("backend,variant,M,K,N,fmts,dtype,bias,residual", list(_swiglu_sweep()))
def test_quantized_swiglu_sweep(backend, variant, M, K, N, fmts, dtype, bias, residual):
    require_backend(backend)
    run_swiglu_case(backend, variant, M, K, N, fmts, dtype, bias, residual)


@pytest.mark.parametrize("fmts,expected", [
    ((Q4, Q4), {"swiglu_fused": 1, "swiglu_split": 0, "gemm": 0}),
    ((Q4, Q8), {"swiglu_fused": 0, "swiglu_split": 1, "gemm": 1}),   # mixed: split
    ((None, Q4), {"swiglu_fused": 0, "swiglu_split": 1, "gemm": 1}),
])
def test_quantized_swiglu_variant_rule(msl_backend, fmts, expected):
    x = randn((7, 64), mx.float16, 0)
    wg, wu = weight(40, 64, fmts[0], mx.float16, 1), weight(40, 64, fmts[1], mx.float16, 2)
    before = {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] for k in expected}
    mx.eval(swiglu(x, wg, wu, backend=msl_backend))
    assert {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] - before[k] for k in expected} == expected


def test_quantized_swiglu_errors():
    x = randn((4, 64), mx.float16, 0)
    wg, w8 = weight(40, 64, Q4, mx.float16, 1), weight(40, 64, Q8, mx.float16, 2)
    w32 = weight(40, 64, Q4, mx.float32, 3)
    wd = weight(64, 40, None, mx.float16, 4)
    with pytest.raises(ValueError, match="variant 'fused' needs w_gate and w_up in one format"):
        swiglu(x, wg, w8, variant="fused", backend="reference")
    with pytest.raises(TypeError, match="w_up.scales has dtype float32 but x has float16"):
        swiglu(x, wg, w32, backend="reference")
    with pytest.raises(ValueError, match=r"w_up.w has 8 words per row, i.e. K=64 at 4 bits; "
                                         r"expected K=128"):
        swiglu(randn((4, 128), mx.float16, 0), weight(40, 128, Q4, mx.float16, 1), wg,
               backend="reference")
    with pytest.raises(ValueError, match=r"w_down must have shape \(K=64, N_mlp=40\) .*got "
                                         r"\(64, 64\)"):
        swiglu_mlp(x, wg, wg, weight(64, 64, Q4, mx.float16, 5), backend="reference")
    with pytest.raises(TypeError, match="w_down.scales has dtype float32"):
        swiglu_mlp(x, wg, wg, weight(64, 64, Q4, mx.float32, 5), backend="reference")
    assert swiglu_mlp(x, wg, wg, wd, backend="reference").shape == (4, 64)


# ---- RMSNorm + QKV --------------------------------------------------------------------------

def run_qkv_case(backend, B, L, K, heads, head_dim, fmts, dtype, bias, tile=None):
    """fmts: (q, k, v) formats, each None (float) or (bits, group_size)."""
    dt = DTYPES[dtype]
    s = B * 31 + L + K + sum(map(hash, fmts)) % 97
    rng = np.random.default_rng(s)
    x = mx.array((rng.standard_normal((B, L, K)) * 2).astype(np.float32)).astype(dt)
    nw = mx.array((rng.standard_normal(K) * 0.2 + 1).astype(np.float32)).astype(dt)
    counts = (heads[0], heads[1], heads[1])
    ws = [weight(n * head_dim, K, f, dt, s + i) for i, (n, f) in enumerate(zip(counts, fmts))]
    bs = [randn((n * head_dim,), dt, s + 10 + i) if bias else None
          for i, n in enumerate(counts)]
    out = rms_norm_qkv(x, nw, EPS, *ws, *bs, n_heads=heads[0], n_kv_heads=heads[1],
                       head_dim=head_dim, tile=tile, backend=backend)
    x64 = to_f64(x)
    h64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * to_f64(nw)
    h = mx.fast.rms_norm(x, nw, EPS)
    what = f"{backend} B={B} L={L} K={K} heads={heads} {fmts} {dtype} bias={bias} {tile}"
    for name, o, w, b, n in zip("qkv", out, ws, bs, counts):
        y64, y = h64 @ dequant64(w).T, product(h, w)
        if bias:
            y64, y = y64 + to_f64(b), y + b
        heads_layout = (B, L, n, head_dim)
        assert tuple(o.shape) == (B, n, L, head_dim) and o.dtype == dt, f"{what} {name}"
        assert_dtype_close(o, y64.reshape(heads_layout).transpose(0, 2, 1, 3),
                           y.reshape(heads_layout).transpose(0, 2, 1, 3), dtype=dt,
                           what=f"{what} {name}")


# B, L, K, (n_heads, n_kv_heads), head_dim, (q, k, v) formats, dtype, bias
QKV_COVER = [
    (1, 7, 128, (4, 2), 64, (Q4, Q8, (6, 128)), "float16", False),   # mixed bits
    (2, 5, 256, (2, 1), 64, (None, (3, 32), (5, 64)), "bfloat16", True),  # float q
    (1, 33, 128, (4, 4), 32, ((2, 32), (2, 32), (2, 32)), "float32", True),  # one format
]
QKV_TILES = [
    (1, 70, 128, (2, 2), 64, (Q4, Q4, Q8), "float16", "64x64_sb"),
    (2, 9, 64, (4, 1), 32, (Q8, (4, 32), None), "float32", "32x32_sb"),
    (1, 70, 128, (2, 2), 64, (Q4, (3, 32), Q8), "bfloat16", "64x64_bk16"),  # BK = 16, 3-bit
]


def _qkv_sweep():
    for bits, gs, dtype in itertools.product(BITS, GROUP_SIZES, DTYPES):
        key = (bits, gs, dtype)
        B, L = _pick(((1, 1), (1, 7), (2, 33)), *key)
        other = _pick((None, Q4, Q8, (bits, gs)), *key, "k")
        fmts = ((bits, gs), other, _pick((None, Q8, (3, 32), (bits, gs)), *key, "v"))
        case = (B, L, 384, (4, 2), 64, fmts, dtype, _pick((False, True), *key, "bias"))
        for backend in KERNEL_BACKENDS:
            ident = "-".join(map(str, (backend, *key)))
            slow = backend in CPU_BACKENDS and not sampled(ident, SAMPLE_ONE_IN)
            yield pytest.param(backend, *case, id=ident,
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("B,L,K,heads,head_dim,fmts,dtype,bias", QKV_COVER)
def test_quantized_rms_norm_qkv(kernel_backend, B, L, K, heads, head_dim, fmts, dtype, bias):
    run_qkv_case(kernel_backend, B, L, K, heads, head_dim, fmts, dtype, bias)


@pytest.mark.parametrize("B,L,K,heads,head_dim,fmts,dtype,tile", QKV_TILES)
def test_quantized_rms_norm_qkv_tiles(kernel_backend, B, L, K, heads, head_dim, fmts, dtype,
                                      tile):
    run_qkv_case(kernel_backend, B, L, K, heads, head_dim, fmts, dtype, True,
                 tile=tile_for(kernel_backend, tile))


@pytest.mark.parametrize("backend,B,L,K,heads,head_dim,fmts,dtype,bias", list(_qkv_sweep()))
def test_quantized_rms_norm_qkv_sweep(backend, B, L, K, heads, head_dim, fmts, dtype, bias):
    require_backend(backend)
    run_qkv_case(backend, B, L, K, heads, head_dim, fmts, dtype, bias)


def test_quantized_rms_norm_qkv_errors():
    x = randn((1, 3, 64), mx.float16, 0)
    nw = randn((64,), mx.float16, 1)
    wq, wk = weight(32, 64, Q4, mx.float16, 2), weight(16, 64, Q8, mx.float16, 3)

    def call(**over):
        args = dict(x=x, norm_weight=nw, eps=EPS, wq=wq, wk=wk, wv=wk, n_heads=2, n_kv_heads=1,
                    head_dim=16, backend="reference")
        return rms_norm_qkv(**{**args, **over})

    with pytest.raises(TypeError, match="wk.scales has dtype float32 but x has float16"):
        call(wk=weight(16, 64, Q8, mx.float32, 3))
    with pytest.raises(ValueError, match=r"wv must have shape \(16, 64\)"):
        call(wv=wq)
    with pytest.raises(ValueError, match="wq.mode must be 'affine'"):
        call(wq=QuantizedWeight(wq.w, wq.scales, wq.biases, 64, 4, "nvfp4"))
    with pytest.raises(ValueError, match=r"wk.scales must have shape \(16, 2\)"):
        call(wk=QuantizedWeight(wk.w, wk.scales[:, :1], wk.biases, 32, 8))
