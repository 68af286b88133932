"""Brick 3 (``swiglu``, ``swiglu_mlp``) against float64 numpy and stock mlx-lm, on every backend.

The issue's sweep (M x K x N_mlp x dtype x bias x residual, both variants) runs in full on
``metal``; on the emulator the default suite runs a covering subset per variant (every value of
every axis at least once), on ``reference`` (which has no variants) the union of those subsets,
and the rest of the cross product is marked slow. A case with a residual checks ``swiglu_mlp``
end to end (down projection through the GEMM brick, residual in its epilogue); a case without
one checks ``swiglu``'s ``act`` directly. An emulator fault (out-of-bounds access, race,
unwritten output) raises, so a passing emulator test is also a clean fault report.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.swiglu.msl import FUSED_TILES, plan_fused, select_fused_tile
from mlx_bricks.bricks.swiglu.op import swiglu, swiglu_mlp
from mlx_bricks.bricks.swiglu.variants import VARIANT_ENV_VAR, VARIANTS, resolve_variant
from tests.support import require_backend, sampled
from tests.tolerance import assert_dtype_close, to_f64

swiglu_ops = importlib.import_module("mlx_bricks.bricks.swiglu.variants")

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SWEEP_M = (1, 7, 100, 257)
SWEEP_K = (64, 576, 1000)
SWEEP_N = (72, 1536, 1000)

# Emulator cases of the default suite, per variant: (M, K, N_mlp, dtype, bias, residual). Every
# value of every axis appears for each variant; the large products are paired with small M so
# the emulator stays fast. Tiles, scalar K loads and aligned stores are covered by
# test_tile_variants.
# Besides the cover, the default suite runs about one emulator case in SAMPLE_ONE_IN of the
# sweep, a fixed hash-chosen sample (tests.support.sampled) among the cases of at most
# SAMPLE_MAX_MACS multiply-adds per product (as test_swiglu_activation: an M=257, K=1000,
# N=1536 case takes about a minute on the emulator, and the cover already pairs each large
# axis value with small ones); `-m slow` runs the rest.
SAMPLE_ONE_IN = 16
SAMPLE_MAX_MACS = 4e7
EMULATOR_COVER = {
    "fused": {
        (1, 1000, 1536, "float16", True, False),
        (7, 576, 1000, "bfloat16", False, True),
        (100, 64, 72, "float32", True, True),
        (257, 576, 72, "float16", False, False),
    },
    "split": {
        (1, 64, 1536, "float32", True, True),
        (7, 576, 1000, "float16", True, False),
        (100, 1000, 72, "bfloat16", False, True),
        (257, 64, 72, "float16", False, False),
    },
}




def _randn(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


@functools.lru_cache(maxsize=4)
def _data(M, K, N, dtype, seed=0):
    """Operands of one (M, K, N_mlp, dtype) (biases and residual included; cases pick), their
    float64 gate/up pre-activations and the same-dtype MLX products."""
    dt = DTYPES[dtype]
    s = seed + M * 7 + K * 3 + N
    x = _randn((M, K), dt, s)
    wg = _randn((N, K), dt, s + 1, 1.0 / math.sqrt(K))
    wu = _randn((N, K), dt, s + 2, 1.0 / math.sqrt(K))
    wd = _randn((K, N), dt, s + 3, 1.0 / math.sqrt(N))
    bg, bu, bd = _randn((N,), dt, s + 4), _randn((N,), dt, s + 5), _randn((K,), dt, s + 6)
    r = _randn((M, K), dt, s + 7)
    x64 = to_f64(x)
    g64, u64 = x64 @ to_f64(wg).T, x64 @ to_f64(wu).T
    xg, xu = x @ wg.T, x @ wu.T
    mx.eval(x, wg, wu, wd, bg, bu, bd, r, xg, xu)
    return dict(x=x, wg=wg, wu=wu, wd=wd, bg=bg, bu=bu, bd=bd, r=r, g64=g64, u64=u64, xg=xg,
                xu=xu)


def _silu64(g):
    # float64 SiLU that stays finite for any g: exp of -|g| only.
    e = np.exp(-np.abs(g))
    return np.where(g >= 0, g / (1.0 + e), g * e / (1.0 + e))


def _gelu_tanh64(g):
    """float64 GELU, tanh approximation (``mlx.nn.gelu_approx``'s formula)."""
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


# gate activations by the ops' ``activation`` name: float64 numpy, and the same-dtype MLX one
_ACT64 = {"silu": _silu64, "gelu_tanh": _gelu_tanh64}
_ACT_NAIVE = {"silu": nn.silu, "gelu_tanh": nn.gelu_approx}


def _act64(d, bias, activation="silu"):
    g, u = d["g64"], d["u64"]
    if bias:
        g, u = g + to_f64(d["bg"]), u + to_f64(d["bu"])
    return _ACT64[activation](g) * u


def _act_naive(d, bias, activation="silu"):
    """The same-dtype MLX computation (as mlx-lm's MLP does it): matmuls, activation, multiply."""
    g, u = d["xg"], d["xu"]
    if bias:
        g, u = g + d["bg"], u + d["bu"]
    return _ACT_NAIVE[activation](g) * u


def _run_case(backend, variant, M, K, N, dtype, bias, residual, activation=None):
    """One sweep case against float64; ``activation`` None calls the ops without it (SiLU,
    their default), a name passes it explicitly."""
    d = _data(M, K, N, dtype)
    dt = DTYPES[dtype]
    kw = dict(b_gate=d["bg"], b_up=d["bu"]) if bias else {}
    if activation is not None:
        kw["activation"] = activation
    act = activation or "silu"
    what = (f"{backend} {variant} {act} M={M} K={K} N_mlp={N} {dtype} bias={bias} "
            f"residual={residual}")
    if not residual:
        out = swiglu(d["x"], d["wg"], d["wu"], variant=variant, backend=backend, **kw)
        assert out.dtype == dt and tuple(out.shape) == (M, N), what
        assert_dtype_close(out, _act64(d, bias, act), _act_naive(d, bias, act), dtype=dt,
                           what=what)
        return
    b_down = d["bd"] if bias else None
    out = swiglu_mlp(d["x"], d["wg"], d["wu"], d["wd"], d["r"], b_down=b_down, variant=variant,
                     backend=backend, **kw)
    assert out.dtype == dt and tuple(out.shape) == (M, K), what
    ref64 = _act64(d, bias, act) @ to_f64(d["wd"]).T + to_f64(d["r"])
    naive = _act_naive(d, bias, act) @ d["wd"].T + d["r"]
    if bias:
        ref64, naive = ref64 + to_f64(d["bd"]), naive + d["bd"]
    assert_dtype_close(out, ref64, naive, dtype=dt, what=what)


def _sweep_params():
    for case in itertools.product(SWEEP_M, SWEEP_K, SWEEP_N, DTYPES, (False, True),
                                  (False, True)):
        ident = "-".join(map(str, case))
        marks = [] if any(case in cover for cover in EMULATOR_COVER.values()) \
            else [pytest.mark.slow]
        yield pytest.param("reference", None, *case, marks=marks, id=f"reference-{ident}")
        for variant in VARIANTS:
            yield pytest.param("metal", variant, *case, id=f"metal-{variant}-{ident}")
            yield pytest.param("cuda", variant, *case, id=f"cuda-{variant}-{ident}")
            eid = f"emulator-{variant}-{ident}"
            small = case[0] * case[1] * case[2] <= SAMPLE_MAX_MACS
            fast = case in EMULATOR_COVER[variant] or (small and sampled(eid, SAMPLE_ONE_IN))
            yield pytest.param("emulator", variant, *case, id=eid,
                               marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("backend,variant,M,K,N,dtype,bias,residual", list(_sweep_params()))
def test_sweep(backend, variant, M, K, N, dtype, bias, residual):
    require_backend(backend)
    _run_case(backend, variant, M, K, N, dtype, bias, residual)


def test_emulator_cover_is_covering():
    for variant, cases in EMULATOR_COVER.items():
        cols = list(zip(*cases))
        for axis, values in zip(cols, (SWEEP_M, SWEEP_K, SWEEP_N, tuple(DTYPES), (False, True),
                                       (False, True))):
            assert set(axis) == set(values), f"{variant}: {sorted(axis)} misses {values}"


# Tiles forced through `tile=`, so every tile meets every load/store path whatever the rule.
TILE_CASES = [
    # variant, tile, M, K, N_mlp, dtype: what it covers
    ("fused", "64x32", 128, 64, 64, "float16"),    # aligned M/N (unchecked store), vector loads
    ("fused", "64x32", 65, 33, 70, "bfloat16"),    # unaligned, scalar loads (K odd), K tail
    ("fused", "32x16", 33, 1000, 40, "float32"),   # unaligned, vector loads with a K tail
    ("fused", "64x64", 100, 40, 130, "float16"),   # doubled accumulators (opt-in tile)
    ("split", "64x64", 65, 9, 130, "float32"),     # scalar loads, unaligned, checked epilogue
    ("split", "32x32", 64, 64, 64, "bfloat16"),    # aligned: unchecked epilogue reads up
    # single-buffered pipeline (STAGES = 1)
    ("fused", "64x32_sb", 100, 40, 130, "bfloat16"),  # unaligned, scalar loads, K tail
    ("fused", "32x16_sb", 64, 64, 64, "float16"),  # aligned, no K tail
    ("split", "32x32_sb", 33, 1000, 40, "float32"),  # vector loads with a K tail
    # BK = 16 (32-row weight and x tiles: idle loader threads) and scheduling hints
    ("fused", "32x16_bk16", 33, 1000, 40, "float16"),  # idle loader threads, K tail
    ("fused", "64x32_bk16_sb_sh", 65, 33, 70, "bfloat16"),  # scalar loads (K odd)
    ("fused", "64x64_sh", 128, 64, 64, "float32"),  # hints, aligned
    ("split", "32x32_bk16_sh", 65, 9, 130, "bfloat16"),  # idle loader threads, scalar loads
]


@pytest.mark.parametrize("variant,tile,M,K,N,dtype", TILE_CASES)
def test_tile_variants(kernel_backend, variant, tile, M, K, N, dtype):
    if kernel_backend == "cuda":
        pytest.skip("MSL tile names; the CUDA tiles are covered by tests/test_cuda_compile.py "
                    "and the cuda sweep")
    d = _data(M, K, N, dtype, seed=1)
    out = swiglu(d["x"], d["wg"], d["wu"], b_gate=d["bg"], b_up=d["bu"], variant=variant,
                 tile=tile, backend=kernel_backend)
    assert_dtype_close(out, _act64(d, True), _act_naive(d, True), dtype=DTYPES[dtype],
                       what=f"{kernel_backend} {variant} {tile} M={M} K={K} N={N} {dtype}")


# ---- SiLU at large magnitudes ----------------------------------------------------------------

# Gate values around exp's overflow (|g| ~ 88) and far beyond, up to fp16's largest finite.
LARGE_GATES = (0.0, 1.0, -1.0, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0, 1e3, -1e3,
               1e4, -1e4, 3e4, -3e4, 6e4, -6e4, 65504.0, -65504.0)


def _large_gate_operands(dtype, source):
    """x (M, K) and weights whose gate pre-activations are LARGE_GATES (column n gets
    LARGE_GATES[n % len]) and whose up values stay below 0.5 in magnitude, so every product is
    finite in fp16. source "weight": exact operands, x[:, 0] = x[:, 1] = 1, w_gate[:, 0] = the
    gates, w_up[:, 1] = multiples of 1/64 (other weight columns 0), so gate and up are exact in
    every dtype; source "bias": b_gate = the gates on top of small random products."""
    M, K, N = 9, 64, 48
    vals = np.array([LARGE_GATES[n % len(LARGE_GATES)] for n in range(N)], np.float32)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((M, K)).astype(np.float32)
    to = lambda a: mx.array(a).astype(dtype)  # noqa: E731
    if source == "weight":
        x[:, :2] = 1.0
        wg = np.zeros((N, K), np.float32)
        wg[:, 0] = vals
        wu = np.zeros((N, K), np.float32)
        wu[:, 1] = rng.integers(-31, 32, N) / 64.0
        return to(x), to(wg), to(wu), None, None
    wg = (rng.standard_normal((N, K)) * 1e-3).astype(np.float32)
    wu = (rng.standard_normal((N, K)) * 0.01).astype(np.float32)
    bu = (rng.standard_normal(N) * 0.01).astype(np.float32)
    return to(x), to(wg), to(wu), to(vals), to(bu)


@pytest.mark.parametrize("source", ["weight", "bias"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_large_magnitude_gates(kernel_backend, variant, dtype, source):
    dt = DTYPES[dtype]
    x, wg, wu, bg, bu = _large_gate_operands(dt, source)
    out = swiglu(x, wg, wu, b_gate=bg, b_up=bu, variant=variant, backend=kernel_backend)
    what = f"{kernel_backend} {variant} {dtype} {source}"
    o = to_f64(out)
    assert np.isfinite(o).all(), f"{what}: non-finite output"
    lin64 = lambda w, b: to_f64(x) @ to_f64(w).T + (0.0 if b is None else to_f64(b))  # noqa: E731
    g64, u64 = lin64(wg, bg), lin64(wu, bu)
    assert np.abs(g64).max() >= 6e4
    naive = nn.silu(x @ wg.T + (0 if bg is None else bg)) * (x @ wu.T + (0 if bu is None else bu))
    assert_dtype_close(out, _silu64(g64) * u64, naive, dtype=dt, what=what)
    # Far below exp's range SiLU is -0 (times up: 0); far above it, g itself. With exact gate
    # and up, SiLU(g) * up = g * up exactly in float32: only the output rounding remains.
    assert (o[g64 < -150] == 0).all(), what
    if source == "weight":
        pos = g64 > 150
        rtol = {"float16": 2**-11, "bfloat16": 2**-8, "float32": 2**-24}[dtype]
        np.testing.assert_allclose(o[pos], (g64 * u64)[pos], rtol=rtol, atol=0, err_msg=what)


# ---- shapes, views, module-level equivalence --------------------------------------------------

def _views():
    """Non-contiguous x of logical shape (..., K=64) built from larger arrays."""
    base = _randn((2, 40, 96), mx.float16, 21)
    return {
        "k_slice": base[:, :17, :64],        # 3-D, row stride 96: 128-bit loads
        "reversed": base[:, ::-2, 8:72],     # negative row stride, 16-byte offset
        "transposed": mx.swapaxes(_randn((2, 64, 17), mx.float16, 22), 1, 2),  # K stride 17
    }


@pytest.mark.parametrize("view", sorted(_views()))
@pytest.mark.parametrize("variant", VARIANTS)
def test_leading_dims_and_views(kernel_backend, variant, view):
    x = _views()[view]
    w = _data(1, 64, 72, "float16", seed=5)
    out = swiglu(x, w["wg"], w["wu"], b_gate=w["bg"], variant=variant, backend=kernel_backend)
    assert tuple(out.shape) == (*x.shape[:-1], 72)
    x64 = to_f64(x)
    ref64 = _silu64(x64 @ to_f64(w["wg"]).T + to_f64(w["bg"])) * (x64 @ to_f64(w["wu"]).T)
    naive = nn.silu(x @ w["wg"].T + w["bg"]) * (x @ w["wu"].T)
    assert_dtype_close(out, ref64, naive, dtype=mx.float16,
                       what=f"{kernel_backend} {variant} view={view}")


def test_one_dimensional_x_and_empty_rows(kernel_backend):
    d = _data(1, 64, 72, "float32", seed=6)
    out = swiglu(d["x"][0], d["wg"], d["wu"], backend=kernel_backend)
    assert tuple(out.shape) == (72,)
    assert_dtype_close(out, _act64(d, False)[0], _act_naive(d, False)[0], dtype=mx.float32,
                       what=f"{kernel_backend} 1-D x")
    empty = swiglu(d["x"][:0], d["wg"], d["wu"], backend=kernel_backend)
    assert tuple(empty.shape) == (0, 72) and empty.dtype == mx.float32


@pytest.mark.parametrize("M,K,N", [(1, 4, 1), (2, 3, 5)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_operands(kernel_backend, variant, M, K, N):
    # MLX passes inputs of fewer than 8 elements in the constant address space: here x, the
    # weights, the biases and up (for split) in several mixes of constant and device.
    d = _data(M, K, N, "float32", seed=11)
    out = swiglu_mlp(d["x"], d["wg"], d["wu"], d["wd"], d["r"], b_gate=d["bg"], b_up=d["bu"],
                     b_down=d["bd"], variant=variant, backend=kernel_backend)
    ref64 = _act64(d, True) @ to_f64(d["wd"]).T + to_f64(d["bd"]) + to_f64(d["r"])
    naive = _act_naive(d, True) @ d["wd"].T + d["bd"] + d["r"]
    assert_dtype_close(out, ref64, naive, dtype=mx.float32,
                       what=f"{kernel_backend} {variant} M={M} K={K} N={N}")


def _llama_mlp(hidden, inter, bias, dtype, seed):
    from mlx_lm.models.llama import MLP, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=1,
                     intermediate_size=inter, num_attention_heads=1, rms_norm_eps=1e-5,
                     vocab_size=32, mlp_bias=bias)
    mx.random.seed(seed)
    mlp = MLP(args)
    mlp.set_dtype(dtype)
    return mlp


@pytest.mark.parametrize("bias,dtype", [(False, "bfloat16"), (True, "float32")])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_mlx_lm_llama_mlp(kernel_backend, variant, bias, dtype):
    dt = DTYPES[dtype]
    mlp = _llama_mlp(96, 200, bias, dt, seed=7)
    x = _randn((2, 13, 96), dt, 8)
    stock = mlp(x)
    b = (lambda lin: lin.bias if bias else None)  # noqa: E731
    out = swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                     b_gate=b(mlp.gate_proj), b_up=b(mlp.up_proj), b_down=b(mlp.down_proj),
                     variant=variant, backend=kernel_backend)
    assert out.dtype == stock.dtype and out.shape == stock.shape
    x64 = to_f64(x)
    lin64 = (lambda lin, a: a @ to_f64(lin.weight).T  # noqa: E731
             + (to_f64(lin.bias) if bias else 0.0))
    ref64 = lin64(mlp.down_proj, _silu64(lin64(mlp.gate_proj, x64)) * lin64(mlp.up_proj, x64))
    assert_dtype_close(out, ref64, stock, dtype=dt,
                       what=f"{kernel_backend} {variant} llama MLP bias={bias} {dtype}")


# ---- which kernels run -----------------------------------------------------------------------

@pytest.mark.parametrize("variant,expected", [
    ("fused", {"swiglu_fused": 1, "swiglu_split": 0, "gemm": 0}),
    ("split", {"swiglu_fused": 0, "swiglu_split": 1, "gemm": 1}),
])
def test_variant_launches(msl_backend, variant, expected):
    d = _data(7, 64, 72, "float16", seed=9)
    before = {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] for k in expected}
    mx.eval(swiglu(d["x"], d["wg"], d["wu"], variant=variant, backend=msl_backend))
    after = {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] - before[k] for k in expected}
    assert after == expected


def test_swiglu_mlp_launches_down_gemm_once(msl_backend):
    d = _data(7, 64, 72, "float32", seed=10)
    keys = ("swiglu_fused", "gemm")
    before = {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] for k in keys}
    mx.eval(swiglu_mlp(d["x"], d["wg"], d["wu"], d["wd"], d["r"], backend=msl_backend))
    assert {k: kernels.LAUNCH_COUNTS[(k, msl_backend)] - before[k] for k in keys} == \
        {"swiglu_fused": 1, "gemm": 1}


# ---- variant rule, tile rule, threadgroup memory ----------------------------------------------

def test_variant_rule(monkeypatch):
    assert resolve_variant(None) == swiglu_ops.DEFAULT_VARIANT == "fused"
    monkeypatch.setenv(VARIANT_ENV_VAR, "split")
    assert resolve_variant(None) == "split"
    assert resolve_variant("fused") == "fused"  # the argument wins over the environment
    monkeypatch.setenv(VARIANT_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=f"{VARIANT_ENV_VAR}='fast': expected one of fused, split"):
        resolve_variant(None)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("tile", sorted(FUSED_TILES))
def test_fused_threadgroup_memory_within_limit(dtype, tile):
    p = plan_fused(100, 100, 100, dtype, tile=tile)
    t = FUSED_TILES[tile]
    stages = 1 if "_sb" in tile else 2
    assert t.stages == stages and t.sched == ("_sh" in tile)
    assert p.bk == (16 if "_bk16" in tile else 64 // dtype.size)
    expected = stages * (t.bm + 2 * t.bn) * (p.bk + p.pad) * dtype.size
    assert p.threadgroup_bytes == expected <= 32 * 1024


def test_fused_threadgroup_memory_limit_is_enforced(monkeypatch):
    monkeypatch.setattr(importlib.import_module("mlx_bricks.bricks.gemm.msl"),
                        "THREADGROUP_MEMORY_LIMIT", 16 * 1024)
    with pytest.raises(RuntimeError, match="threadgroup memory"):
        plan_fused(64, 64, 64, mx.float16, tile="64x64")


@pytest.mark.parametrize("M,N,tile", [
    (1, 14336, "32x16"), (4096, 16, "32x16"), (257, 72, "32x16"), (257, 1536, "64x32"),
    (2048, 14336, "64x32"), (33, 32 * 32, "64x32"), (33, 31 * 32, "32x16"),
])
def test_fused_tile_rule(M, N, tile):
    assert select_fused_tile(M, N) == tile


@pytest.mark.parametrize("M,N,K", [(1, 72, 64), (257, 1536, 1000), (65, 70, 33)])
def test_fused_grid_covers_the_output(M, N, K):
    for tile, t in FUSED_TILES.items():
        p = plan_fused(M, N, K, mx.bfloat16, tile=tile)
        assert p.grid[0] % p.threadgroup[0] == 0 and p.threadgroup[0] == t.threads
        assert p.grid[0] // p.threadgroup[0] * t.bn >= N and p.grid[1] * t.bm >= M
        assert p.align_mn == (M % t.bm == 0 and N % t.bn == 0)
        assert p.vec == (K % 8 == 0)


# ---- argument errors --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_errors(backend):
    x, wg, wu = _randn((4, 8), mx.float16, 0), _randn((6, 8), mx.float16, 1), \
        _randn((6, 8), mx.float16, 2)
    wd = _randn((8, 6), mx.float16, 3)
    f16 = lambda *s: mx.zeros(s, mx.float16)  # noqa: E731
    cases = [
        (ValueError, r"variant must be None or one of 'fused', 'split', got 'fast'",
         lambda: swiglu(x, wg, wu, variant="fast", backend=backend)),
        (ValueError, "variant must be None or one of",
         lambda: swiglu_mlp(x, wg, wu, wd, variant="both", backend=backend)),
        (ValueError, r"tile must be None or, for variant 'fused', one of",
         lambda: swiglu(x, wg, wu, tile="64x64x", backend=backend)),
        (ValueError, r"tile must be None or, for variant 'split', one of",
         lambda: swiglu(x, wg, wu, variant="split", tile="64x32", backend=backend)),
        (TypeError, "x must be an mx.array", lambda: swiglu(np.zeros((4, 8)), wg, wu)),
        (TypeError, "w_up must be an mx.array", lambda: swiglu(x, wg, None)),
        (TypeError, "x must be float16", lambda: swiglu(x.astype(mx.int32), wg, wu)),
        (TypeError, "w_gate has dtype float32",
         lambda: swiglu(x, wg.astype(mx.float32), wu, backend=backend)),
        (TypeError, "b_up has dtype float32",
         lambda: swiglu(x, wg, wu, b_up=mx.zeros((6,)), backend=backend)),
        (ValueError, "w_gate must have 2 dimensions", lambda: swiglu(x, wg[0], wu)),
        (ValueError, r"w_gate must have shape \(N_mlp, K=8\)",
         lambda: swiglu(x, wg[:, :5], wu[:, :5], backend=backend)),
        (ValueError, r"w_up must have the shape of w_gate \(6, 8\), got \(5, 8\)",
         lambda: swiglu(x, wg, wu[:5], backend=backend)),
        (ValueError, r"b_gate must have shape \(N_mlp=6,\)",
         lambda: swiglu(x, wg, wu, b_gate=f16(5), backend=backend)),
        (ValueError, "non-empty last dimension",
         lambda: swiglu(x[:, :0], wg[:, :0], wu[:, :0], backend=backend)),
        (ValueError, r"w_down must have shape \(K=8, N_mlp=6\)",
         lambda: swiglu_mlp(x, wg, wu, wd.T, backend=backend)),
        (TypeError, "w_down has dtype float32",
         lambda: swiglu_mlp(x, wg, wu, wd.astype(mx.float32), backend=backend)),
        (ValueError, r"b_down must have shape \(K=8,\)",
         lambda: swiglu_mlp(x, wg, wu, wd, b_down=f16(6), backend=backend)),
        (ValueError, r"residual must have the output shape \(4, 8\)",
         lambda: swiglu_mlp(x, wg, wu, wd, f16(4, 6), backend=backend)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()

