"""The composite variants of the quantized kinds (``bricks/dequantize/composite.py``):
"dequantize the weight, then the stock float computation", tiled over N under the cap.

Every composite a kind offers on a backend (``mx.dequantize`` everywhere, the dequantize brick
where the backend has its kernel, the products through NumPy's float32 BLAS on the CPU) against float64 numpy of the weights decoded from their
packed bits, with the tolerance rule (the same-dtype computation is stock MLX's:
``mx.quantized_matmul`` for every quantized projection), with the default cap and with a cap
small enough for several tiles; the tiles counted and sized against the cap; the CPU's peak
memory under the cap; bad cap values.
"""
from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.dequantize import composite
from mlx_bricks.bricks.gemm.kind import LINEAR
from mlx_bricks.bricks.norm_qkv.kind import RMS_NORM_QKV
from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP
from mlx_bricks.formats.affine import QuantizedWeight
from tests.quant_support import DTYPES, dequant64, even_tiles, mlp_case, product, randn, weight
from tests.support import require_backend
from tests.tolerance import assert_dtype_close, to_f64

Q4, Q8, Q3 = (4, 64), (8, 32), (3, 32)
EPS = 1e-5
#: Small enough for several row tiles in every case below.
SMALL_CAP = 48 << 10


def _composites(kind, args, backend, cap):
    settings = {} if cap is None else {composite.CAP_SETTING: cap}
    return kind.variants(backend, args=args, names=(), settings=settings)


def _expected_names(backend, names):
    """The composites offered: ``names`` (the dequantize brick's where the backend has it),
    each group followed by its NumPy-BLAS twin where MLX runs on the CPU."""
    from mlx_bricks.bricks.dequantize.op import has_kernel
    from mlx_bricks.cpu import on_cpu

    out = []
    for n in names:
        if has_kernel(backend) or "brick" not in n:
            out.append(n)
        if n.startswith("dequant_brick") and on_cpu():
            out.append("blas" + n[len("dequant_brick"):])
    return out


def _check_all(kind, args, backend, cap, ref64, naive, dt, names, what):
    cands = _composites(kind, args, backend, cap)
    assert [v.name for v in cands] == _expected_names(backend, names), what
    for v in cands:
        out = v.run(args, backend)
        outs, refs, naives = (out, ref64, naive) if isinstance(out, tuple) else (
            (out,), (ref64,), (naive,))
        for o, r, n in zip(outs, refs, naives):
            assert o.dtype == dt and tuple(o.shape) == r.shape, f"{what} {v.name}"
            assert_dtype_close(o, r, n, dtype=dt, what=f"{what} {v.name} cap={cap}")


# ---- linear ---------------------------------------------------------------------------------

LINEAR_CASES = [  # B, L, K, N, format, dtype, bias, residual
    (1, 7, 128, 96, Q4, "float16", True, True),
    (2, 5, 256, 160, Q3, "bfloat16", False, True),
    (1, 9, 128, 200, (8, 128), "float32", True, False),
    (1, 3, 64, 72, (6, 64), "float16", False, False),
]


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("B,L,K,N,fmt,dtype,bias,residual", LINEAR_CASES)
def test_linear_composites(kernel_backend, cap, B, L, K, N, fmt, dtype, bias, residual):
    dt = DTYPES[dtype]
    s = B + L + K + N
    x = randn((B, L, K), dt, s)
    w = weight(N, K, fmt, dt, s + 1)
    b = randn((N,), dt, s + 2) if bias else None
    r = randn((B, L, N), dt, s + 3) if residual else None
    ref = to_f64(x) @ dequant64(w).T
    naive = product(x, w)
    if bias:
        ref, naive = ref + to_f64(b), naive + b
    if residual:
        ref, naive = ref + to_f64(r), r + naive
    args = {"x": x, "weight": w, "bias": b, "residual": r}
    _check_all(LINEAR, args, kernel_backend, cap, ref, naive, dt, ["dequant", "dequant_brick"],
               f"{kernel_backend} linear {fmt} {dtype}")


def test_float_weights_get_only_the_blas_composite():
    """Float weights: no dequantize composite; where MLX runs on the CPU the NumPy-BLAS one
    (its products in float32), within the tolerance rule of float64."""
    from mlx_bricks.cpu import on_cpu

    x = randn((1, 4, 64), mx.float16, 0)
    args = {"x": x, "weight": randn((32, 64), mx.float16, 1), "bias": None, "residual": None}
    cands = _composites(LINEAR, args, "reference", None)
    assert [v.name for v in cands] == (["blas"] if on_cpu() else [])
    for v in cands:
        assert_dtype_close(v.run(args, "reference"), to_f64(x) @ to_f64(args["weight"]).T,
                           x @ args["weight"].T, dtype=mx.float16, what="float blas")
    mlp = {"x": x, "w_gate": randn((48, 64), mx.float16, 2), "w_up": randn((48, 64), mx.float16,
                                                                           3),
           "w_down": randn((64, 48), mx.float16, 4), "b_gate": None, "b_up": None,
           "b_down": None, "residual": None}
    assert [v.name for v in _composites(SWIGLU_MLP, mlp, "emulator", None)] == (
        ["blas_fused", "blas_split"] if on_cpu() else [])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_blas_tiles_write_one_output(dtype):
    """The BLAS tiles under a small cap (blocks of x's rows and of the weight's rows) written in
    place into one output, as the one-tile result within the tolerance rule of float64 (two
    weights with a finish too; OpenBLAS may sum a block's rows in another order); a 0-row x
    gives (0, N); the peak memory stays within the output and about one cap (no
    concatenation of every tile beside the output)."""
    from mlx_bricks.cpu import on_cpu

    if not on_cpu():
        pytest.skip("the BLAS composites run where MLX computes on the CPU")
    dt = DTYPES[dtype]

    def tiles(cap):
        return composite.DenseTiles(cap, "mx", "reference", gemm="blas")

    x, w, b = randn((2, 37, 64), dt, 5), randn((300, 64), dt, 6), randn((300,), dt, 7)
    ref = to_f64(x) @ to_f64(w).T
    for cap in (1 << 40, 20_000):
        assert_dtype_close(tiles(cap).linear(x, (w,), (b,)), ref + to_f64(b), x @ w.T + b,
                           dtype=dt, what=f"blas tiles, cap {cap}")

        def glu(g, u):
            return g * u

        assert_dtype_close(tiles(cap).linear(x, (w, w), (b, None), finish=glu),
                           (ref + to_f64(b)) * ref, (x @ w.T + b) * (x @ w.T), dtype=dt,
                           what=f"two weights and a finish, cap {cap}")
    assert tiles(20_000).linear(x[:, :0], (w,), (b,)).shape == (2, 0, 300)
    x, w = randn((1, 512, 512), dt, 8), randn((4096, 512), dt, 9)
    mx.eval(x, w)
    cap = 1 << 20
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(tiles(cap).linear(x, (w,), (None,)))
    out_bytes = 512 * 4096 * dt.size
    assert mx.get_peak_memory() - before <= out_bytes + 1.5 * cap


# ---- RMSNorm + QKV --------------------------------------------------------------------------

QKV_CASES = [  # B, L, K, (heads, kv heads), head_dim, (q, k, v formats), dtype, bias
    (1, 7, 128, (4, 2), 32, (Q4, Q4, Q8), "float16", False),
    (2, 5, 128, (2, 1), 64, (Q8, None, (4, 32)), "bfloat16", True),
    (1, 6, 64, (2, 2), 32, (None, None, Q3), "float32", True),
]


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("B,L,K,heads,head_dim,fmts,dtype,bias", QKV_CASES)
def test_rms_norm_qkv_composites(kernel_backend, cap, B, L, K, heads, head_dim, fmts, dtype,
                                 bias):
    dt = DTYPES[dtype]
    s = B * L + K + head_dim
    H, Hkv = heads
    x = randn((B, L, K), dt, s)
    nw = randn((K,), dt, s + 1, scale=0.3) + 1.0
    ws = [weight(n * head_dim, K, f, dt, s + 2 + i) for i, (n, f) in enumerate(
        zip((H, Hkv, Hkv), fmts))]
    bs = [randn((w.shape[0],), dt, s + 5 + i) if bias else None for i, w in enumerate(ws)]
    x64 = to_f64(x)
    h64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * to_f64(nw)
    h = mx.fast.rms_norm(x, nw, EPS)
    refs, naives = [], []
    for w, b, n in zip(ws, bs, (H, Hkv, Hkv)):
        y64, y = h64 @ dequant64(w).T, product(h, w)
        if b is not None:
            y64, y = y64 + to_f64(b), y + b
        refs.append(y64.reshape(B, L, n, head_dim).transpose(0, 2, 1, 3))
        naives.append(y.reshape(B, L, n, head_dim).transpose(0, 2, 1, 3))
    args = {"x": x, "norm_weight": nw, "eps": EPS, "wq": ws[0], "wk": ws[1], "wv": ws[2],
            "bq": bs[0], "bk": bs[1], "bv": bs[2], "n_heads": H, "n_kv_heads": Hkv,
            "head_dim": head_dim}
    _check_all(RMS_NORM_QKV, args, kernel_backend, cap, tuple(refs), tuple(naives), dt,
               ["dequant", "dequant_brick"], f"{kernel_backend} qkv {fmts} {dtype}")


# ---- SwiGLU MLP -----------------------------------------------------------------------------

MLP_CASES = [  # M, K, F, (gate, up, down formats), dtype, bias, residual, activation
    (7, 128, 96, (Q4, Q4, Q8), "float16", True, True, "silu"),
    (9, 64, 160, (Q3, Q3, (6, 32)), "bfloat16", False, True, "silu"),
    (5, 128, 64, (None, Q4, Q4), "float32", True, False, "silu"),  # gate and up differ: split
    (6, 64, 96, (Q8, Q8, None), "float16", False, False, "gelu_tanh"),
]


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("M,K,F,fmts,dtype,bias,residual,activation", MLP_CASES)
def test_swiglu_mlp_composites(kernel_backend, cap, M, K, F, fmts, dtype, bias, residual,
                               activation):
    args, ref, naive, dt = mlp_case(M, K, F, fmts, dtype, bias, residual, activation)
    names = (["dequant_split", "dequant_brick_split"] if fmts[0] != fmts[1] else
             ["dequant_fused", "dequant_brick_fused", "dequant_split", "dequant_brick_split"])
    _check_all(SWIGLU_MLP, args, kernel_backend, cap, ref, naive, dt, names,
               f"{kernel_backend} mlp {fmts} {dtype} {activation}")


def test_a_fixed_mlp_variant_keeps_its_styles_composites():
    from mlx_bricks.cpu import on_cpu

    x = randn((3, 64), mx.float16, 0)
    args = {"x": x, "w_gate": weight(32, 64, Q4, mx.float16, 1),
            "w_up": weight(32, 64, Q4, mx.float16, 2), "w_down": weight(64, 32, Q8, mx.float16, 3),
            "b_gate": None, "b_up": None, "b_down": None, "residual": None}
    for style in ("fused", "split"):
        settings = {"variant": style, "fixed": True}
        kept = SWIGLU_MLP.restrict(SWIGLU_MLP.variants("emulator", args=args, settings=settings),
                                   settings)
        want = [style, f"dequant_{style}", f"dequant_brick_{style}"]
        assert [v.name for v in kept] == want + ([f"blas_{style}"] if on_cpu() else [])


# ---- the cap --------------------------------------------------------------------------------

def _record_tiles(monkeypatch, how="mx"):
    """Wrap the dequantizer ``how``: every tile it makes is recorded as (rows, K, bits)."""
    tiles = []
    d = composite.DEQUANTIZERS[how]

    def fn(q, dtype, backend):
        tiles.append((q.shape[0], q.shape[1], q.bits))
        return d.fn(q, dtype, backend)

    monkeypatch.setitem(composite.DEQUANTIZERS, how,
                        composite.Dequantizer(fn, d.peak))
    return tiles, d.peak


@pytest.mark.parametrize("how,backend", [("mx", "reference"), ("brick", "emulator")])
def test_tiles_never_exceed_the_cap(monkeypatch, how, backend):
    require_backend(backend)
    tiles, peak = _record_tiles(monkeypatch, how)
    dt = mx.float16
    F = 224
    x = randn((1, 5, 128), dt, 0)
    wg, wu, wd = (weight(F, 128, Q4, dt, 1), weight(F, 128, Q4, dt, 2), weight(128, F, Q8, dt, 3))
    args = {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd, "b_gate": None, "b_up": None,
            "b_down": None, "residual": None}
    cap = 20 << 10
    v = {c.name: c for c in _composites(SWIGLU_MLP, args, backend, cap)}
    name = "dequant" if how == "mx" else "dequant_brick"
    mx.eval(v[f"{name}_fused"].run(args, backend))
    # gate and up side by side: 2 * rows per tile, each counted at the dequantizer's peak
    # plus the stacked packed copy; then the down projection's own tiles
    per_row_gu = 128 * (2 * peak(4, dt) + 2 * (4 / 8 + 2 * 2 / 64))
    rows_gu = int(cap // per_row_gu)
    rows_d = int(cap // (F * peak(8, dt)))
    gu, d = even_tiles(F, rows_gu), even_tiles(128, rows_d)
    assert tiles == ([(2 * r, 128, 4) for r in gu] + [(r, F, 8) for r in d])
    assert len(tiles) > 4
    for rows, K, bits in tiles:
        assert rows * K * peak(bits, dt) <= cap
    tiles.clear()
    mx.eval(v[f"{name}_split"].run(args, backend))
    rows_1 = int(cap // (128 * peak(4, dt)))
    assert sum(r for r, K, _ in tiles if K == 128) == 2 * F
    assert max(r for r, K, _ in tiles if K == 128) == max(even_tiles(F, rows_1))
    assert max(even_tiles(F, rows_1)) <= rows_1 < F


def test_a_cap_below_one_row_is_one_row(monkeypatch):
    tiles, _ = _record_tiles(monkeypatch)
    x = randn((1, 3, 256), mx.float32, 0)
    args = {"x": x, "weight": weight(6, 256, Q4, mx.float32, 1), "bias": None, "residual": None}
    (v, *_) = _composites(LINEAR, args, "reference", 1)
    mx.eval(v.run(args, "reference"))
    assert tiles == [(1, 256, 4)] * 6


def test_a_default_cap_grows_to_the_call_output_on_a_gpu(monkeypatch):
    """A default cap (not the user's) is raised per call to the bytes the call's products
    write where the device queues (``options.call_cap``): fewer, larger tiles of the same
    values; the user's cap, and any cap on a backend that does not queue, stay as they are."""
    tiles, peak = _record_tiles(monkeypatch)
    dt = mx.float16
    K, N, M = 128, 96, 64
    w = weight(N, K, Q4, dt, 1)
    x = randn((1, M, K), dt, 0)
    want, naive = to_f64(x) @ dequant64(w).T, product(x, w)
    cap = 8 << 10
    per_row = K * peak(4, dt)
    out_bytes = M * N * dt.size
    assert cap < out_bytes  # the call writes more than the cap: it grows

    def tile_rows(strict, backend):
        tiles.clear()
        y = composite.DenseTiles(cap, "mx", backend, strict=strict).linear(x, (w,), (None,))
        assert_dtype_close(y, want, naive, dtype=dt, what=backend)
        composite.IN_FLIGHT.reset()
        return [r for r, _, _ in tiles]

    assert tile_rows(False, "cuda") == even_tiles(N, int(out_bytes // per_row))
    for strict, backend in ((True, "cuda"), (True, "reference"), (False, "reference")):
        assert tile_rows(strict, backend) == even_tiles(N, int(cap // per_row)), (strict, backend)
    assert int(cap // per_row) < int(out_bytes // per_row)


def test_call_cap_and_whose_cap_it_is(monkeypatch):
    from mlx_bricks.options import call_cap

    assert call_cap(10, False, "cuda", 25) == 25 and call_cap(10, False, "metal", 5) == 10
    assert call_cap(10, True, "cuda", 25) == 10 and call_cap(10, False, "reference", 25) == 10
    assert call_cap(10, False, "emulator", 25) == 10
    monkeypatch.delenv(composite.CAP_ENV_VAR, raising=False)
    assert not composite.cap_is_strict({})  # the default
    assert composite.cap_is_strict({composite.CAP_SETTING: 1})  # the patch's, unmarked
    assert not composite.cap_is_strict({composite.CAP_SETTING: 1,
                                        composite.CAP_STRICT_SETTING: False})
    monkeypatch.setenv(composite.CAP_ENV_VAR, "2")
    assert composite.cap_is_strict({})


@pytest.mark.parametrize("fmt", [Q4, Q3])
def test_cpu_peak_memory_stays_under_the_cap(fmt):
    """On the CPU the tiled mx.dequantize + GEMM holds at most the cap (the output aside)."""
    dt = mx.float16
    x = randn((16, 1024), dt, 0)
    w = weight(4096, 1024, fmt, dt, 1)
    args = {"x": x, "weight": w, "bias": None, "residual": None}
    mx.eval(x, w.w, w.scales, w.biases)
    cap = 1 << 20
    with mx.stream(mx.cpu):
        (v,) = [c for c in _composites(LINEAR, args, "reference", cap) if c.name == "dequant"]
        mx.eval(v.run(args, "reference"))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = v.run(args, "reference")
        mx.eval(y)
        peak = mx.get_peak_memory() - base
    assert peak <= cap + 2 * y.nbytes, peak / cap
    # all in one tile, the same computation holds many times more
    assert cap < 4096 * 1024 * 2


@pytest.mark.parametrize("value,message", [
    (0, "dequant_cap must be a number of MiB above 0, got 0"),
    (-3, "dequant_cap must be a number of MiB above 0, got -3"),
    (float("nan"), "dequant_cap must be a number of MiB above 0, got nan"),
    (float("inf"), "dequant_cap must be a number of MiB above 0, got inf"),
    ("256MB", "dequant_cap must be a number of MiB above 0, got '256MB'"),
])
def test_bad_cap_argument(value, message):
    with pytest.raises(ValueError) as e:
        composite.resolve_cap(value)
    assert str(e.value) == message


@pytest.mark.parametrize("value", [True, [1], object()])
def test_cap_argument_of_another_type(value):
    with pytest.raises(TypeError, match="dequant_cap must be a number of MiB above 0"):
        composite.resolve_cap(value)


@pytest.mark.parametrize("env", ["abc", "0", "-1", "nan", "1e400"])
def test_bad_cap_environment(monkeypatch, env):
    monkeypatch.setenv(composite.CAP_ENV_VAR, env)
    with pytest.raises(ValueError) as e:
        composite.resolve_cap()
    assert str(e.value) == f"MLX_BRICKS_DEQUANT_CAP={env!r}: expected a number of MiB above 0"
    assert "\n" not in str(e.value)


def test_cap_sources(monkeypatch):
    monkeypatch.delenv(composite.CAP_ENV_VAR, raising=False)
    assert composite.resolve_cap() == (256 << 20, "default")
    monkeypatch.setenv(composite.CAP_ENV_VAR, " 0.5 ")
    assert composite.resolve_cap() == (1 << 19, "env")
    assert composite.resolve_cap(64) == (64 << 20, "argument")
    monkeypatch.setenv(composite.CAP_ENV_VAR, "")
    assert composite.resolve_cap() == (256 << 20, "default")
    # relative to the model's weights when none is given: 1/32 of them, 1 MiB to 256 MiB
    frac = "default, 1/32 of the weights"
    assert composite.resolve_cap(model_bytes=100 << 20) == ((100 << 20) // 32, frac)
    assert composite.resolve_cap(model_bytes=1 << 20) == (1 << 20, frac)
    assert composite.resolve_cap(model_bytes=16 << 30) == (256 << 20, "default")
    assert composite.resolve_cap(64, model_bytes=1 << 20) == (64 << 20, "argument")


def test_tile_rows_are_the_weights_rows():
    w = weight(64, 128, Q4, mx.float16, 0)
    rows = composite._rows(w, 8, 24)
    assert isinstance(rows, QuantizedWeight) and rows.shape == (16, 128)
    assert mx.array_equal(rows.dequantize(), w.dequantize()[8:24]).item()
