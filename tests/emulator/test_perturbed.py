"""The perturbed mode (issue 28): what Metal may vary within its specification, varied for real
(float32 subnormals flushed, fast:: errors at the documented bounds, shuffled accumulation
orders), deterministically per seed; and the bricks' kernels keep their tolerance under it."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em
from tests.tolerance import assert_dtype_close, to_f64


def _run(name, body, x, out_dtype=mx.float32, header=""):
    k = em.metal_kernel(name, ["x"], ["y"], body, header)
    n = x.shape[0]
    (y,) = k(inputs=[x], grid=(n, 1, 1), threadgroup=(min(n, 256), 1, 1),
             output_shapes=[(n,)], output_dtypes=[out_dtype])
    return np.array(y)


def test_float32_subnormals_flush_only_when_perturbed():
    x = mx.array(np.full(32, 1e-20, np.float32))
    body = """
        uint i = thread_position_in_grid.x;
        float sub = x[i] * x[i];                 // 1e-40: a float32 subnormal
        y[i] = i % 2 ? sub * 1e30f : (sub > 0.0f ? 1.0f : 0.0f);
    """
    with em.checks(perturb=0):  # (the suite may run under MLX_BRICKS_EMULATOR_PERTURB)
        plain = _run("ftz", body, x)
    assert plain[0] == 1.0 and np.isclose(plain[1], 1e-10, rtol=1e-2)
    with em.checks(perturb=5):
        flushed = _run("ftz", body, x)
    assert flushed.tolist() == [0.0] * 32


_EXP_X = np.linspace(-20, 5, 256).astype(np.float32)


def _ulps(a, b):
    """Distance in float32 units in the last place (same sign)."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return np.abs(ia - ib)


def test_fast_exp2_moves_within_the_documented_bound():
    x = mx.array(_EXP_X)
    body = "uint i = thread_position_in_grid.x; y[i] = fast::exp2(x[i]);"
    with em.checks(perturb=0):
        plain = _run("fexp2", body, x)
        precise = _run("pexp2", "uint i = thread_position_in_grid.x; y[i] = precise::exp2(x[i]);",
                       x)
    np.testing.assert_array_equal(plain, precise)  # unperturbed, fast:: is the precise value
    with em.checks(perturb=11):
        fast = _run("fexp2", body, x)
    moved = _ulps(fast, precise)
    bound = 3 + np.floor(np.abs(2 * _EXP_X))
    assert np.all(moved <= bound)
    assert (moved == bound).mean() > 0.3  # at the edges of the bound, where tolerances break


def test_fast_tanh_is_the_formula_metal_documents():
    # (t - 1) / (t + 1) with t = exp(2 x): NaN once t overflows, where precise::tanh is 1.
    x = mx.array(np.array([0.5, 10.0, 50.0, -50.0] * 8, np.float32))
    body = "uint i = thread_position_in_grid.x; y[i] = fast::tanh(x[i]);"
    with em.checks(perturb=3):
        y = _run("ftanh", body, x)
    assert np.isclose(y[0], np.tanh(0.5), rtol=1e-5) and np.isclose(y[1], 1.0)
    assert np.isnan(y[2]) and y[3] == -1.0


_SUM_BODY = """
    uint i = thread_position_in_grid.x;
    y[i] = simd_sum(x[i]);
"""


def _sum_inputs():
    v = np.ones(32, np.float32)
    v[::4] = 1e8
    v[2::4] = -1e8
    return mx.array(v)


def test_simd_sum_order_is_shuffled_per_seed_and_deterministic():
    x = _sum_inputs()
    exact = float(np.sum(np.array(x).astype(np.float64)))  # 16
    with em.checks(perturb=0):
        plain = _run("ssum", _SUM_BODY, x)
    results = set()
    for seed in range(1, 9):
        with em.checks(perturb=seed):
            a = _run("ssum", _SUM_BODY, x)
            b = _run("ssum", _SUM_BODY, x)
        np.testing.assert_array_equal(a, b)  # one seed, one order (and both schedules agree)
        assert len(set(a.tolist())) == 1     # every lane gets the same sum
        results.add(float(a[0]))
    assert len(results) > 1 and results != {float(plain[0])}
    assert all(abs(r - exact) <= 16 * 8 for r in results)  # rounding error of 1e8-sized terms


def test_mma_accumulation_order_is_shuffled():
    # Each 8x8 product sums terms of mixed magnitude, so the order shows in the last bits.
    body = """
        const uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 a, b, c;
        simdgroup_load(a, x, 8);
        simdgroup_load(b, x + 64, 8);
        simdgroup_load(c, x + 128, 8);
        simdgroup_multiply_accumulate(c, a, b, c);
        simdgroup_store(c, y, 8);
        (void)lane;
    """
    rng = np.random.default_rng(0)
    vals = (rng.standard_normal(192) * 10.0 ** rng.integers(-4, 5, 192)).astype(np.float32)
    k = em.metal_kernel("mma_order", ["x"], ["y"], body)

    def run():
        (y,) = k(inputs=[mx.array(vals)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(64,)], output_dtypes=[mx.float32])
        return np.array(y)

    with em.checks(perturb=0):
        plain = run()
    A, B, C = (vals[i * 64:(i + 1) * 64].reshape(8, 8).astype(np.float64) for i in range(3))
    exact = (A @ B + C).reshape(-1)
    with em.checks(perturb=21):
        shuffled = run()
    assert not np.array_equal(shuffled, plain)
    scale = (np.abs(A) @ np.abs(B) + np.abs(C)).reshape(-1)
    assert np.all(np.abs(shuffled - exact) <= 9 * 2.0**-23 * scale)


def test_perturb_setting_is_checked(monkeypatch):
    from mlx_bricks.emulator import _checks_from_env

    with pytest.raises(ValueError, match="perturb"):
        em.set_checks(perturb=-1)
    with pytest.raises(ValueError, match="perturb"):
        em.set_checks(perturb=True)
    monkeypatch.setenv("MLX_BRICKS_EMULATOR_PERTURB", "17")
    assert _checks_from_env().perturb == 17
    monkeypatch.setenv("MLX_BRICKS_EMULATOR_PERTURB", "off")
    assert _checks_from_env().perturb == 0
    monkeypatch.setenv("MLX_BRICKS_EMULATOR_PERTURB", "lots")
    with pytest.raises(ValueError, match="MLX_BRICKS_EMULATOR_PERTURB"):
        _checks_from_env().perturb


# ---------------------------------------------------------------------------------------------
# Representative bricks under the perturbed mode (the CI-cheap check; the whole kernel suite
# runs under MLX_BRICKS_EMULATOR_PERTURB before a release, docs/emulator.md).


def _rand(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_bricks_keep_their_tolerance_when_perturbed(dtype):
    from mlx_bricks.ops import decode_attention, flash_attention, linear

    x, w = _rand((40, 72), dtype, 1), _rand((48, 72), dtype, 2)
    q, k, v = _rand((1, 4, 3, 64), dtype, 3), _rand((1, 2, 70, 64), dtype, 4), \
        _rand((1, 2, 70, 64), dtype, 5)
    with em.checks(perturb=1234):
        y = linear(x, w, backend="emulator")
        att = flash_attention(q, k, v, scale=0.125, mask="causal", backend="emulator")
        dec = decode_attention(q, k, v, scale=0.125, mask="causal", splits=3, backend="emulator")
    ref = to_f64(x) @ to_f64(w).T
    assert_dtype_close(y, ref, x @ w.T, dtype=dtype, what="linear")
    q64, k64, v64 = to_f64(q), np.repeat(to_f64(k), 2, axis=1), np.repeat(to_f64(v), 2, axis=1)
    s = q64 @ np.swapaxes(k64, -1, -2) * 0.125
    s = np.where(np.arange(70)[None, :] <= np.arange(3)[:, None] + 67, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p @ v64) / p.sum(-1, keepdims=True)
    naive = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert_dtype_close(att, ref, naive, dtype=dtype, what="flash_attention")
    assert_dtype_close(dec, ref, naive, dtype=dtype, what="decode_attention")
