"""The SwiGLU brick's gate activation (``activation="silu" | "gelu_tanh"``, the kernels' ``ACT``
template parameter) against float64 numpy, on every backend.

``gelu_tanh`` (GeGLU with GELU's tanh approximation, gemma's ``nn.gelu_approx``) is swept like
SiLU in test_swiglu.py: on the emulator the default suite runs a covering subset per variant and
a fixed hash-chosen sample, the rest of the cross product is marked slow. SiLU's own sweep is in
test_swiglu.py (it is the default); here ``activation="silu"`` passed explicitly is checked to
run the same kernel as the default. An emulator fault (out-of-bounds, race, unwritten output)
raises, so a passing emulator test is also a clean fault report.
"""
from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_bricks import kernels
from mlx_bricks.bricks.swiglu.op import ACTIVATIONS, VARIANTS, swiglu, swiglu_mlp
from mlx_bricks.bricks.swiglu.variants import activation_code
from tests.support import require_backend, sampled
from tests.test_swiglu import (
    _ACT64,
    DTYPES,
    SWEEP_K,
    SWEEP_M,
    SWEEP_N,
    _data,
    _gelu_tanh64,
    _large_gate_operands,
    _randn,
    _run_case,
)
from tests.tolerance import assert_dtype_close, to_f64

SAMPLE_ONE_IN = 32
# The sample draws from the cases of at most this many multiply-adds (M * K * N_mlp): the
# large ones cost the emulator tens of seconds each and run with `-m slow`.
SAMPLE_MAX_MACS = 4e7
# (M, K, N_mlp, dtype, bias, residual) per variant: every value of every axis at least once.
EMULATOR_COVER = {
    "fused": {
        (1, 1000, 1536, "bfloat16", False, True),
        (7, 576, 72, "float16", True, False),
        (100, 64, 1000, "float32", False, False),
        (257, 64, 72, "bfloat16", True, True),
    },
    "split": {
        (1, 576, 72, "float32", False, True),
        (7, 64, 1536, "bfloat16", True, False),
        (100, 1000, 72, "float16", True, True),
        (257, 64, 1000, "float16", False, False),
    },
}


def _sweep_params():
    for case in itertools.product(SWEEP_M, SWEEP_K, SWEEP_N, DTYPES, (False, True),
                                  (False, True)):
        ident = "-".join(map(str, case))
        covered = any(case in cover for cover in EMULATOR_COVER.values())
        yield pytest.param("reference", None, *case, id=f"reference-{ident}",
                           marks=[] if covered else [pytest.mark.slow])
        for variant in VARIANTS:
            yield pytest.param("metal", variant, *case, id=f"metal-{variant}-{ident}")
            yield pytest.param("cuda", variant, *case, id=f"cuda-{variant}-{ident}")
            eid = f"emulator-{variant}-gelu-{ident}"
            small = case[0] * case[1] * case[2] <= SAMPLE_MAX_MACS
            fast = case in EMULATOR_COVER[variant] or (small and sampled(eid, SAMPLE_ONE_IN))
            yield pytest.param("emulator", variant, *case, id=eid,
                               marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("backend,variant,M,K,N,dtype,bias,residual", list(_sweep_params()))
def test_gelu_tanh_sweep(backend, variant, M, K, N, dtype, bias, residual):
    require_backend(backend)
    _run_case(backend, variant, M, K, N, dtype, bias, residual, activation="gelu_tanh")


def test_emulator_cover_is_covering():
    for variant, cases in EMULATOR_COVER.items():
        cols = list(zip(*cases))
        for axis, values in zip(cols, (SWEEP_M, SWEEP_K, SWEEP_N, tuple(DTYPES),
                                       (False, True), (False, True))):
            assert set(values) <= set(axis), (variant, values, axis)


@pytest.mark.parametrize("variant", VARIANTS)
def test_explicit_silu_is_the_default(kernel_backend, variant):
    d = _data(7, 64, 72, "float16")
    default = swiglu(d["x"], d["wg"], d["wu"], variant=variant, backend=kernel_backend)
    explicit = swiglu(d["x"], d["wg"], d["wu"], activation="silu", variant=variant,
                      backend=kernel_backend)
    assert mx.array_equal(default, explicit).item()
    _run_case(kernel_backend, variant, 7, 64, 72, "float16", True, False, activation="silu")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_gelu_tanh_large_magnitude_gates(kernel_backend, variant, dtype):
    # Gates up to fp16's largest finite: g^3 overflows float32 beyond ~7e12 only for float32
    # inputs, but the tanh argument exceeds exp's range far earlier; the clamp keeps it finite.
    dt = DTYPES[dtype]
    x, wg, wu, _, _ = _large_gate_operands(dt, "weight")
    out = swiglu(x, wg, wu, activation="gelu_tanh", variant=variant, backend=kernel_backend)
    what = f"{kernel_backend} {variant} gelu_tanh {dtype}"
    o = to_f64(out)
    assert np.isfinite(o).all(), f"{what}: non-finite output"
    g64, u64 = to_f64(x) @ to_f64(wg).T, to_f64(x) @ to_f64(wu).T
    with np.errstate(over="ignore", invalid="ignore"):
        ref64 = np.where(np.abs(g64) > 20, np.where(g64 > 0, g64, 0.0), _gelu_tanh64(g64)) * u64
    naive = nn.gelu_approx(x @ wg.T) * (x @ wu.T)
    assert_dtype_close(out, ref64, naive, dtype=dt, what=what)
    assert (o[g64 < -20] == 0).all(), what
    pos = g64 > 20  # tanh is 1 in float32: g * up exactly, only the output rounding remains
    rtol = {"float16": 2**-11, "bfloat16": 2**-8, "float32": 2**-24}[dtype]
    np.testing.assert_allclose(o[pos], (g64 * u64)[pos], rtol=rtol, atol=0, err_msg=what)


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_mlx_lm_gemma3_mlp(kernel_backend, variant):
    from mlx_lm.models.gemma3_text import MLP

    mx.random.seed(9)
    mlp = MLP(96, 200)
    mlp.set_dtype(mx.bfloat16)
    x = _randn((2, 13, 96), mx.bfloat16, 10)
    stock = mlp(x)
    out = swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                     activation="gelu_tanh", variant=variant, backend=kernel_backend)
    assert out.dtype == stock.dtype and out.shape == stock.shape
    x64 = to_f64(x)
    lin64 = lambda lin, a: a @ to_f64(lin.weight).T  # noqa: E731
    ref64 = lin64(mlp.down_proj,
                  _gelu_tanh64(lin64(mlp.gate_proj, x64)) * lin64(mlp.up_proj, x64))
    assert_dtype_close(out, ref64, stock, dtype=mx.bfloat16,
                       what=f"{kernel_backend} {variant} gemma3 MLP")


def test_activation_is_a_template_parameter(msl_backend, monkeypatch):
    """One kernel per variant: the activation changes the ACT template value only."""
    require_backend(msl_backend)
    seen = []
    real = kernels.launch

    def spy(name, backend, **kw):
        seen.append((name, dict(kw["template"]).get("ACT")))
        return real(name, backend, **kw)

    monkeypatch.setattr("mlx_bricks.bricks.swiglu.msl.launch", spy)
    d = _data(7, 64, 72, "float16")
    for activation in ACTIVATIONS:
        for variant in VARIANTS:
            swiglu(d["x"], d["wg"], d["wu"], activation=activation, variant=variant,
                   backend=msl_backend)
    assert seen == [(f"swiglu_{v}", ACTIVATIONS[a]) for a in ACTIVATIONS for v in VARIANTS]


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_activation_errors(backend):
    x, wg, wu = (_randn(s, mx.float16, i) for i, s in enumerate([(4, 8), (6, 8), (6, 8)]))
    wd = _randn((8, 6), mx.float16, 3)
    with pytest.raises(ValueError, match=r"activation must be one of 'silu', 'gelu_tanh', "
                                         r"got 'gelu'"):
        swiglu(x, wg, wu, activation="gelu", backend=backend)
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu_mlp(x, wg, wu, wd, activation="relu", backend=backend)
    with pytest.raises(TypeError, match="activation must be a str, got int"):
        swiglu(x, wg, wu, activation=1, backend=backend)
    with pytest.raises(TypeError, match="activation must be a str, got NoneType"):
        swiglu_mlp(x, wg, wu, wd, activation=None, backend=backend)
    assert [activation_code(a) for a in ("silu", "gelu_tanh")] == [0, 1]


def test_tuner_key_stock_and_reference_follow_the_activation():
    """The tuner keys GELU-tanh MLPs apart (SiLU keys unchanged), and its stock side and
    high-precision reference compute the activation asked for (float64 numpy here)."""
    from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP as k

    d = _data(7, 64, 72, "float32")
    args = dict(x=d["x"], w_gate=d["wg"], w_up=d["wu"], w_down=d["wd"], residual=d["r"])
    silu = str(k.key(args))
    assert silu == str(k.key(dict(args, activation="silu"))) and "act=" not in silu
    assert "act=gelu_tanh" in str(k.key(dict(args, activation="gelu_tanh")))
    for activation in ACTIVATIONS:
        a = dict(args, activation=activation)
        ref64 = (_ACT64[activation](d["g64"]) * d["u64"]) @ to_f64(d["wd"]).T + to_f64(d["r"])
        for name, out in (("stock", k.stock(a)), ("reference", k.reference_tail(a, 7))):
            np.testing.assert_allclose(to_f64(out), ref64, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name} {activation}")
