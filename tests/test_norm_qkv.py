"""``mlx_bricks.ops.rms_norm_qkv`` (RMSNorm + Q/K/V projections, head layout) against float64.

The sweep (head_dim x L x B x GQA x bias x dtype) runs in full on ``reference`` and ``metal``;
on the emulator the default suite runs a covering subset and the rest is marked slow.
"""
from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.norm_qkv import msl as norm_qkv
from mlx_bricks.bricks.gemm import msl as gemm
from mlx_bricks.bricks.norm_qkv.msl import plan_rms_norm_qkv
from mlx_bricks.bricks.norm_qkv.op import rms_norm_qkv
from tests.support import require_backend, tile_for
from tests.tolerance import assert_dtype_close, to_f64

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
EPS = 1e-5
HEAD_DIMS = (64, 80, 96, 128)
LS = (1, 7, 100)
BS = (1, 2)
HEADS = ((4, 4), (4, 2), (8, 1))  # (n_heads, n_kv_heads): MHA, GQA 2, GQA 8

# (head_dim, L, B, (n_heads, n_kv_heads), dtype, bias): every value of each axis once or more.
EMULATOR_COVER = {
    (64, 1, 1, (4, 4), "float16", False),
    (80, 7, 2, (4, 2), "bfloat16", True),
    (96, 100, 1, (8, 1), "float32", True),
    (128, 100, 2, (4, 2), "float16", False),
    (64, 7, 2, (8, 1), "bfloat16", True),
}




def _randn(shape, dtype, rng, scale=1.0, shift=0.0):
    return mx.array((rng.standard_normal(shape) * scale + shift).astype(np.float32)).astype(dtype)


def _operands(B, L, K, n_heads, n_kv_heads, head_dim, dtype, bias, seed=0):
    rng = np.random.default_rng(seed)
    x = _randn((B, L, K), dtype, rng, scale=2.0)
    nw = _randn((K,), dtype, rng, scale=0.2, shift=1.0)
    ws = [_randn((n * head_dim, K), dtype, rng, scale=1 / math.sqrt(K))
          for n in (n_heads, n_kv_heads, n_kv_heads)]
    bs = [_randn((n * head_dim,), dtype, rng) if bias else None
          for n in (n_heads, n_kv_heads, n_kv_heads)]
    return x, nw, ws, bs


def _heads(y, B, L, n, head_dim):
    return y.reshape(B, L, n, head_dim).transpose(0, 2, 1, 3)


def _ref64(x, nw, ws, bs, heads, head_dim):
    x64 = to_f64(x)
    h = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * to_f64(nw)
    B, L, _ = x.shape
    out = []
    for w, b, n in zip(ws, bs, heads):
        y = h @ to_f64(w).T + (0.0 if b is None else to_f64(b))
        out.append(np.ascontiguousarray(_heads(y, B, L, n, head_dim)))
    return out


def _naive(x, nw, ws, bs, heads, head_dim):
    """Same-dtype MLX computation, written here independently of rms_norm_qkv_reference."""
    h = mx.fast.rms_norm(x, nw, EPS)
    B, L, _ = x.shape
    out = []
    for w, b, n in zip(ws, bs, heads):
        y = h @ w.T
        out.append(_heads(y if b is None else y + b, B, L, n, head_dim))
    return out


def _run_and_check(backend, x, nw, ws, bs, n_heads, n_kv_heads, head_dim, what, tile=None):
    heads = (n_heads, n_kv_heads, n_kv_heads)
    out = rms_norm_qkv(x, nw, EPS, *ws, *bs, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, tile=tile, backend=backend)
    refs = _ref64(x, nw, ws, bs, heads, head_dim)
    naives = _naive(x, nw, ws, bs, heads, head_dim)
    B, L, _ = x.shape
    for name, o, r, n, hcount in zip("qkv", out, refs, naives, heads):
        assert tuple(o.shape) == (B, hcount, L, head_dim), f"{what}: {name} shape {o.shape}"
        assert o.dtype == x.dtype, f"{what}: {name} dtype {o.dtype}"
        assert_dtype_close(o, r, n, dtype=x.dtype, what=f"{what} {name}")
    return out


def _sweep_params():
    for case in itertools.product(HEAD_DIMS, LS, BS, HEADS, DTYPES, (False, True)):
        for backend in ("metal", "cuda", "emulator", "reference"):
            slow = backend == "emulator" and case not in EMULATOR_COVER
            yield pytest.param(backend, *case, marks=[pytest.mark.slow] if slow else [],
                               id="-".join(map(str, (backend, *case))))


@pytest.mark.parametrize("backend,head_dim,L,B,heads,dtype,bias", list(_sweep_params()))
def test_rms_norm_qkv_sweep(backend, head_dim, L, B, heads, dtype, bias):
    require_backend(backend)
    K = 96
    x, nw, ws, bs = _operands(B, L, K, *heads, head_dim, DTYPES[dtype], bias, seed=head_dim + L)
    _run_and_check(backend, x, nw, ws, bs, *heads, head_dim,
                   what=f"{backend} D={head_dim} L={L} B={B} heads={heads} {dtype} bias={bias}")


# Kernel paths the sweep (K = 96, 128-bit loads, K tail for fp16/bf16) does not reach.
PATHS = [
    # B, L, K, n_heads, n_kv_heads, head_dim, dtype, tile: what it covers
    (2, 64, 64, 2, 2, 64, "float16", "64x64"),   # aligned M/N, no K tail, main tile
    (1, 100, 200, 4, 1, 80, "bfloat16", "64x64"),  # unaligned on the main tile, GQA 4
    (1, 7, 36, 2, 2, 64, "float16", None),       # K % 8 != 0: scalar loads and norm
    (2, 33, 1, 2, 1, 64, "float32", "32x32"),    # K = 1
    (1, 33, 200, 2, 1, 64, "bfloat16", "32x32_bk16_sh"),  # BK = 16, idle loader threads, hints
    (1, 70, 36, 2, 2, 64, "float16", "64x64_bk16_sb"),    # BK = 16, scalar loads, one buffer
]


@pytest.mark.parametrize("B,L,K,n_heads,n_kv_heads,head_dim,dtype,tile", PATHS)
def test_rms_norm_qkv_paths(kernel_backend, B, L, K, n_heads, n_kv_heads, head_dim, dtype, tile):
    x, nw, ws, bs = _operands(B, L, K, n_heads, n_kv_heads, head_dim, DTYPES[dtype], True,
                              seed=K)
    _run_and_check(kernel_backend, x, nw, ws, bs, n_heads, n_kv_heads, head_dim,
                   what=f"{kernel_backend} B={B} L={L} K={K} tile={tile}",
                   tile=tile_for(kernel_backend, tile))


@pytest.mark.parametrize("view", ["slice", "transposed"])
def test_rms_norm_qkv_strided_x(kernel_backend, view):
    rng = np.random.default_rng(3)
    if view == "slice":
        x = _randn((2, 12, 80), mx.float16, rng, scale=2.0)[:, 2:9, 8:72]  # 128-bit path
    else:
        x = mx.swapaxes(_randn((2, 64, 7), mx.float16, rng, scale=2.0), 1, 2)  # K stride 7
    _, nw, ws, bs = _operands(2, 7, 64, 4, 2, 64, mx.float16, True, seed=4)
    _run_and_check(kernel_backend, x, nw, ws, bs, 4, 2, 64, what=f"{kernel_backend} {view}")


def test_rms_norm_qkv_launches_inv_rms_once_then_the_gemm(msl_backend):
    # Issue 15, fix 4: the inverse RMS of each row is computed once (rms_norm_inv, B * L
    # values), not once per column tile of the GEMM.
    x, nw, ws, bs = _operands(1, 5, 32, 2, 1, 64, mx.float32, False, seed=9)
    keys = ("rms_norm_inv", "rms_norm_qkv")
    before = {key: kernels.LAUNCH_COUNTS[(key, msl_backend)] for key in keys}
    q, k, v = rms_norm_qkv(x, nw, EPS, *ws, *bs, n_heads=2, n_kv_heads=1, head_dim=64,
                           backend=msl_backend)
    mx.eval(q, k, v)
    assert {key: kernels.LAUNCH_COUNTS[(key, msl_backend)] - before[key] for key in keys} == \
        {"rms_norm_inv": 1, "rms_norm_qkv": 1}
    _run_and_check(msl_backend, x, nw, ws, bs, 2, 1, 64, what=msl_backend)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape,view", [((3, 7, 200), None), ((2, 5, 36), None),
                                        ((2, 9, 80), "slice"), ((2, 64, 7), "transposed")])
def test_inv_rms_rows(msl_backend, shape, view, dtype):
    """rms_norm_inv against float64 (its only rounding is float32's, as in mx.fast.rms_norm):
    128-bit and scalar loads, strided rows."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = _randn(shape, DTYPES[dtype], rng, scale=3.0)
    if view == "slice":
        x = x[:, 1:8, 8:72]
    elif view == "transposed":
        x = mx.swapaxes(x, 1, 2)
    inv = norm_qkv.inv_rms_rows(x, EPS, msl_backend)
    x64 = to_f64(x).reshape(-1, x.shape[-1])
    want = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1) + EPS)
    assert inv.dtype == mx.float32 and tuple(inv.shape) == (x64.shape[0],)
    np.testing.assert_allclose(np.array(inv), want, rtol=4 * 2.0**-23 * math.sqrt(x.shape[-1]))


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("tile", sorted(gemm.TILES))
def test_threadgroup_memory_within_limit(dtype, tile):
    plan, grid, _, tg_bytes = plan_rms_norm_qkv(100, 8, 2, 128, 4096, dtype, tile=tile)
    # the GEMM's tiles only: the inverse RMS is read from device memory (rms_norm_inv)
    assert tg_bytes == plan.threadgroup_bytes <= 32 * 1024
    assert grid[0] % plan.threadgroup[0] == 0
    tiles_x = grid[0] // plan.threadgroup[0]
    assert tiles_x == math.ceil(8 * 128 / plan.tile.bn) + 2 * math.ceil(2 * 128 / plan.tile.bn)


def _ok():
    rng = np.random.default_rng(0)
    x = _randn((1, 3, 16), mx.float16, rng)
    nw = _randn((16,), mx.float16, rng)
    wq, wk, wv = (_randn((n, 16), mx.float16, rng) for n in (32, 16, 16))
    return x, nw, wq, wk, wv


def test_rms_norm_qkv_errors():
    x, nw, wq, wk, wv = _ok()

    def call(**over):
        args = dict(x=x, norm_weight=nw, eps=EPS, wq=wq, wk=wk, wv=wv, n_heads=2, n_kv_heads=1,
                    head_dim=16, backend="reference")
        return rms_norm_qkv(**{**args, **over})

    cases = [
        (ValueError, "x must have 3 dimensions", dict(x=x[0])),
        (TypeError, "x must be float16", dict(x=x.astype(mx.int32))),
        (TypeError, "wk has dtype", dict(wk=wk.astype(mx.float32))),
        (ValueError, r"norm_weight must have shape \(16,\)", dict(norm_weight=nw[:8])),
        (ValueError, r"wq must have shape \(32, 16\)", dict(wq=wq[:16])),
        (ValueError, r"wv must have shape \(16, 16\)", dict(n_kv_heads=1, wv=wq)),
        (ValueError, r"bk must have shape \(16,\)",
         dict(bq=wq[:, 0], bk=wq[:, 0], bv=wk[:, 0])),
        (ValueError, "given together", dict(bq=wq[:, 0])),
        (TypeError, "eps must be a float", dict(eps="1e-5")),
        (ValueError, "eps must be finite", dict(eps=-1.0)),
        (TypeError, "n_heads must be an int", dict(n_heads=2.0)),
        (ValueError, "head_dim must be >= 1", dict(head_dim=0)),
        (ValueError, "tile must be None", dict(tile="16x16")),
    ]
    for exc, match, over in cases:
        with pytest.raises(exc, match=match):
            call(**over)
