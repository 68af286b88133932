"""Known-answer tests: the emulator runs MSL with Metal semantics (float64 numpy references)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em

FLOAT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def as_f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def rand(shape, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# elementwise, attributes, scalars


@pytest.mark.parametrize("dname", list(FLOAT_DTYPES))
def test_elementwise_template_dtype(dname):
    dt = FLOAT_DTYPES[dname]
    k = em.metal_kernel(
        "ew_axpb", ["x", "alpha"], ["y"],
        """
        uint i = thread_position_in_grid.x;
        if (i < x_shape[0]) y[i] = T(float(x[i]) * alpha + 0.5f);
        """,
    )
    x = rand((1000,), dt)
    (y,) = k(inputs=[x, 1.5], grid=(1000, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(1000,)], output_dtypes=[dt], template=[("T", dt)])
    assert y.dtype == dt
    want = as_f64(x) * 1.5 + 0.5
    got = as_f64(y)
    eps = {"float16": 2**-10, "bfloat16": 2**-7, "float32": 2**-23}[dname]
    np.testing.assert_allclose(got, want, rtol=eps, atol=eps)


def test_partial_threadgroups_and_attributes():
    """grid counts threads; edge threadgroups are partial; threads_per_threadgroup reports the
    partial size, dispatch_threads_per_threadgroup the requested one."""
    k = em.metal_kernel(
        "attrs", ["dummy"], ["o"],
        """
        uint3 g = thread_position_in_grid;
        uint idx = g.y * threads_per_grid.x + g.x;
        o[idx * 8 + 0] = threads_per_threadgroup.x;
        o[idx * 8 + 1] = threads_per_threadgroup.y;
        o[idx * 8 + 2] = dispatch_threads_per_threadgroup.x;
        o[idx * 8 + 3] = thread_index_in_threadgroup;
        o[idx * 8 + 4] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
        o[idx * 8 + 5] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y;
        o[idx * 8 + 6] = threadgroup_position_in_grid.x * 100 + thread_position_in_threadgroup.x;
        o[idx * 8 + 7] = simdgroups_per_threadgroup;
        """,
    )
    gx, gy, tx, ty = 50, 3, 16, 2
    (o,) = k(inputs=[mx.zeros((8,))], grid=(gx, gy, 1), threadgroup=(tx, ty, 1),
             output_shapes=[(gx * gy * 8,)], output_dtypes=[mx.uint32])
    o = np.array(o).reshape(gy, gx, 8)
    for y in range(gy):
        for x in range(gx):
            bx, by = x // tx, y // ty
            ax, ay = min(tx, gx - bx * tx), min(ty, gy - by * ty)
            lx, ly = x - bx * tx, y - by * ty
            lin = ly * ax + lx
            want = [ax, ay, tx, lin, (lin // 32) * 100 + lin % 32,
                    ((gx + tx - 1) // tx) * 100 + (gy + ty - 1) // ty, bx * 100 + lx,
                    (ax * ay + 31) // 32]
            assert list(o[y, x]) == want, (x, y)


def test_threadgroup_clipped_to_grid():
    """MLX launches min(threadgroup, grid) per dimension."""
    k = em.metal_kernel("clip", ["d"], ["o"],
                        "o[thread_position_in_grid.x] = threads_per_threadgroup.x * 1000 + "
                        "dispatch_threads_per_threadgroup.x;")
    (o,) = k(inputs=[mx.zeros((8,))], grid=(5, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(5,)], output_dtypes=[mx.int32])
    assert np.array(o).tolist() == [5005] * 5


def test_scalars_and_strides():
    k = em.metal_kernel(
        "scal", ["x", "n", "flag", "s"], ["o"],
        """
        uint i = thread_position_in_grid.x;
        if (i < uint(n)) {
          int64_t off = elem_to_loc(i, x_shape, x_strides, x_ndim);
          o[i] = flag ? x[off] * s : -1.0f;
        }
        """,
    )
    x = rand((3, 5))
    (o,) = k(inputs=[x, 15, True, 2.0], grid=(15, 1, 1), threadgroup=(8, 1, 1),
             output_shapes=[(15,)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(o), np.array(x).reshape(-1) * 2.0, rtol=1e-6)


def test_vector_types_and_conversions():
    k = em.metal_kernel(
        "vecs", ["x"], ["o", "h"],
        """
        uint i = thread_position_in_grid.x;
        float4 v = float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
        half4 hv = half4(v);                 // conversion, not a bit cast
        float4 w = static_cast<float4>(hv) + float4(1.0f);
        float2 s = w.zw + float2(v.x, 2.0h);
        int4 q = int4(w);                    // truncation toward zero
        o[i] = s.x + s.y + float(q.x) + as_type<float>(as_type<uint>(v.y)) + (float4(hv)).w;
        h[i] = select(hv.x, hv.y, v.x > v.y) + metal::max(hv.z, 0.0h) + fast::exp(half(0));
        """,
    )
    x = rand((64,))
    (o, h) = k(inputs=[x], grid=(16, 1, 1), threadgroup=(16, 1, 1),
               output_shapes=[(16,), (16,)], output_dtypes=[mx.float32, mx.float16])
    xv = np.array(x).astype(np.float64).reshape(16, 4)
    hv = xv.astype(np.float16).astype(np.float64)
    w = hv + 1
    want = w[:, 2] + xv[:, 0] + w[:, 3] + 2 + np.trunc(w[:, 0]) + xv[:, 1] + hv[:, 3]
    np.testing.assert_allclose(np.array(o), want, rtol=1e-5, atol=1e-5)
    want_h = np.where(xv[:, 0] > xv[:, 1], hv[:, 1], hv[:, 0]) + np.maximum(hv[:, 2], 0) + 1
    np.testing.assert_allclose(np.array(h).astype(np.float64), want_h, rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# barriers and reductions

REDUCE = """
threadgroup float buf[256];
uint t = thread_index_in_threadgroup;
buf[t] = x[thread_position_in_grid.x];
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint s = 128; s > 0; s >>= 1) {
  if (t < s) buf[t] += buf[t + s];
  BARRIER
}
if (t == 0) o[threadgroup_position_in_grid.x] = buf[0];
"""


def test_threadgroup_reduction_with_barriers():
    k = em.metal_kernel("tg_reduce", ["x"], ["o"],
                        REDUCE.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"))
    x = rand((4 * 256,))
    (o,) = k(inputs=[x], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(4,)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(o), np.array(x).astype(np.float64).reshape(4, 256).sum(1),
                               rtol=1e-5, atol=1e-5)


def test_missing_barrier_is_a_race():
    k = em.metal_kernel("tg_reduce_racy", ["x"], ["o"], REDUCE.replace("BARRIER", ""))
    x = rand((4 * 256,))
    with pytest.raises(em.EmulatorFault, match="race"):
        k(inputs=[x], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
          output_shapes=[(4,)], output_dtypes=[mx.float32])


def test_simd_reductions():
    k = em.metal_kernel(
        "simd_red", ["x"], ["o"],
        """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        float v = x[i];
        float a = simd_sum(v);
        float b = v;
        for (ushort d = 16; d > 0; d /= 2) b += simd_shuffle_down(b, d);
        float c = v;
        for (ushort m = 1; m < 32; m *= 2) c += simd_shuffle_xor(c, m);
        float mx_ = simd_max(v);
        float pre = simd_prefix_exclusive_sum(v);
        float first = simd_broadcast(v, 3);
        o[i * 6 + 0] = a;
        o[i * 6 + 1] = lane == 0 ? b : 0.0f;
        o[i * 6 + 2] = c;
        o[i * 6 + 3] = mx_;
        o[i * 6 + 4] = pre;
        o[i * 6 + 5] = first;
        """,
    )
    x = rand((128,))
    (o,) = k(inputs=[x], grid=(128, 1, 1), threadgroup=(64, 1, 1),
             output_shapes=[(128 * 6,)], output_dtypes=[mx.float32])
    o = np.array(o).reshape(4, 32, 6).astype(np.float64)
    xs = np.array(x).astype(np.float64).reshape(4, 32)
    sums = xs.sum(1)
    np.testing.assert_allclose(o[:, :, 0], np.repeat(sums[:, None], 32, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[:, 0, 1], sums, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[:, :, 2], np.repeat(sums[:, None], 32, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(o[:, :, 3], np.repeat(xs.max(1)[:, None], 32, 1).astype(np.float32))
    excl = np.cumsum(xs, 1) - xs
    np.testing.assert_allclose(o[:, :, 4], excl, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(o[:, :, 5], np.repeat(xs[:, 3:4], 32, 1))


def test_shuffle_down_keeps_own_value_past_the_end():
    k = em.metal_kernel("shdown", ["x"], ["o"],
                        "uint i = thread_position_in_grid.x; o[i] = simd_shuffle_down(x[i], 5);")
    x = mx.arange(32).astype(mx.float32)
    (o,) = k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(32,)], output_dtypes=[mx.float32])
    want = [i + 5 if i + 5 < 32 else i for i in range(32)]
    assert np.array(o).tolist() == want


def test_simd_sum_in_divergent_code_uses_active_lanes():
    k = em.metal_kernel(
        "simd_div", ["x"], ["o"],
        """
        uint lane = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        if (lane < 12) v = simd_sum(v);
        o[thread_position_in_grid.x] = v;
        """,
    )
    x = mx.arange(64).astype(mx.float32)
    (o,) = k(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1),
             output_shapes=[(64,)], output_dtypes=[mx.float32])
    o = np.array(o)
    for s in range(2):
        base = np.arange(32 * s, 32 * s + 32, dtype=np.float64)
        assert o[32 * s: 32 * s + 12].tolist() == [base[:12].sum()] * 12
        assert o[32 * s + 12: 32 * s + 32].tolist() == base[12:].tolist()


def test_partial_simdgroup_reduces_existing_lanes():
    k = em.metal_kernel("simd_partial", ["x"], ["o"],
                        "o[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);")
    x = mx.ones((40,))
    (o,) = k(inputs=[x], grid=(40, 1, 1), threadgroup=(40, 1, 1),
             output_shapes=[(40,)], output_dtypes=[mx.float32])
    assert np.array(o).tolist() == [32.0] * 32 + [8.0] * 8


# ---------------------------------------------------------------------------------------------
# simdgroup_matrix

MMA = """
uint lane = thread_index_in_simdgroup;
simdgroup_matrix<T, 8, 8> a, b;
simdgroup_matrix<float, 8, 8> c, d;
simdgroup_load(a, A + ORIGIN_A, LDA, ulong2(0, 0), TRANS_A);
simdgroup_load(b, B, 8);
simdgroup_load(c, C, 8);
simdgroup_multiply_accumulate(d, a, b, c);
simdgroup_store(d, D, 8);
simdgroup_matrix<T, 8, 8> e;
simdgroup_multiply(e, a, b);
simdgroup_store(e, E, 8);
"""


@pytest.mark.parametrize("dname", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("trans", [False, True])
def test_simdgroup_matrix_multiply_accumulate(dname, trans):
    dt = FLOAT_DTYPES[dname]
    lda = 12
    src = (MMA.replace("ORIGIN_A", "2 * 12 + 3").replace("LDA", str(lda))
           .replace("TRANS_A", "true" if trans else "false"))
    k = em.metal_kernel(f"mma_{dname}_{int(trans)}", ["A", "B", "C"], ["D", "E"], src)
    A = rand((12, 12), dt, 1)
    B = rand((8, 8), dt, 2)
    C = rand((8, 8), mx.float32, 3)
    D, E = k(inputs=[A, B, C], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(8, 8), (8, 8)], output_dtypes=[mx.float32, dt],
             template=[("T", dt)])
    a = as_f64(A)[2:10, 3:11]
    if trans:
        a = a.T
    want = a @ as_f64(B) + as_f64(C)
    np.testing.assert_allclose(as_f64(D), want, rtol=1e-5, atol=1e-5)  # float accumulation
    eps = {"float16": 2**-10, "bfloat16": 2**-7, "float32": 2**-22}[dname]
    np.testing.assert_allclose(as_f64(E), a @ as_f64(B), rtol=2 * eps, atol=2 * eps * 8)


def test_simdgroup_load_store_origin_and_transpose_store():
    k = em.metal_kernel(
        "mma_origin", ["A"], ["O"],
        """
        simdgroup_matrix<float, 8, 8> m;
        simdgroup_load(m, A, 16, ulong2(5, 3));        // column 5, row 3 of a 16-wide matrix
        simdgroup_store(m, O, 10, ulong2(1, 2), true); // transposed, at column 1, row 2
        """,
    )
    A = mx.arange(16 * 16).astype(mx.float32).reshape(16, 16)
    (O,) = k(inputs=[A], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(10, 10)], output_dtypes=[mx.float32], init_value=-1)
    want = -np.ones((10, 10))
    want[2:10, 1:9] = np.array(A)[3:11, 5:13].T
    np.testing.assert_array_equal(np.array(O), want)


def test_thread_elements_layout():
    k = em.metal_kernel(
        "frag_layout", ["A"], ["O"],
        """
        uint lane = thread_index_in_simdgroup;
        simdgroup_matrix<float, 8, 8> m;
        simdgroup_load(m, A, 8);
        vec<float, 2> e = m.thread_elements();
        O[lane * 2] = e[0];
        O[lane * 2 + 1] = e.y;
        simdgroup_matrix<float, 8, 8> z = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        z.thread_elements()[1] = float(lane);  // write through the reference
        simdgroup_store(z, O + 64, 8);
        """,
    )
    A = mx.arange(64).astype(mx.float32).reshape(8, 8)
    (O,) = k(inputs=[A], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(128,)], output_dtypes=[mx.float32])
    O = np.array(O)
    z = np.zeros((8, 8))
    for lane in range(32):
        q = lane // 4
        r = (q & 4) + (lane // 2) % 4
        c = (q & 2) * 2 + (lane % 2) * 2
        assert O[2 * lane] == r * 8 + c and O[2 * lane + 1] == r * 8 + c + 1, lane
        z[r, c + 1] = lane
    np.testing.assert_array_equal(O[64:].reshape(8, 8), z)


# ---------------------------------------------------------------------------------------------
# atomics, init_value, checks


def test_atomic_outputs_histogram():
    k = em.metal_kernel(
        "hist", ["x"], ["counts", "total"],
        """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&counts[x[i]], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&total[0], 0.5f, memory_order_relaxed);
        """,
        atomic_outputs=True,
    )
    rng = np.random.default_rng(0)
    xs = rng.integers(0, 10, size=1000).astype(np.int32)
    counts, total = k(inputs=[mx.array(xs)], grid=(1000, 1, 1), threadgroup=(128, 1, 1),
                      output_shapes=[(10,), (1,)], output_dtypes=[mx.int32, mx.float32],
                      init_value=0)
    np.testing.assert_array_equal(np.array(counts), np.bincount(xs, minlength=10))
    assert float(np.array(total)[0]) == 500.0


def test_init_value_respected():
    k = em.metal_kernel("half_writer", ["x"], ["o"],
                        "uint i = thread_position_in_grid.x; if (i % 2 == 0) o[i] = x[i];")
    x = rand((64,))
    (o,) = k(inputs=[x], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
             output_dtypes=[mx.float32], init_value=7.0)
    o = np.array(o)
    np.testing.assert_array_equal(o[0::2], np.array(x)[0::2])
    np.testing.assert_array_equal(o[1::2], np.full(32, 7.0, np.float32))


def test_unwritten_output_flagged():
    k = em.metal_kernel("half_writer2", ["x"], ["o"],
                        "uint i = thread_position_in_grid.x; if (i != 37) o[i] = x[i];")
    x = rand((64,))
    with pytest.raises(em.EmulatorFault, match=r"1 of 64 elements of output 'o'.*never written.*37"):
        k(inputs=[x], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
          output_dtypes=[mx.float32])
    with em.checks(unwritten=False, schedules=1):
        k(inputs=[x], grid=(64, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(64,)],
          output_dtypes=[mx.float32])


def test_unwritten_integer_output_flagged():
    k = em.metal_kernel("int_writer", ["x"], ["o"],
                        "uint i = thread_position_in_grid.x; if (i < 60) o[i] = int(i);")
    with pytest.raises(em.EmulatorFault, match="4 of 64 elements"):
        k(inputs=[mx.zeros((8,))], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.int32])


def test_out_of_bounds_write_flagged():
    k = em.metal_kernel("oob_write", ["x"], ["o"],
                        "uint i = thread_position_in_grid.x; o[i + 1] = x[i];")
    with pytest.raises(em.EmulatorFault,
                       match=r"out-of-bounds write .*'o' \(64 elements.*element index 64.*"
                             r"thread_position_in_grid=\(63,0,0\)"):
        k(inputs=[rand((64,))], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])


def test_out_of_bounds_read_before_start_flagged():
    k = em.metal_kernel("oob_read", ["x"], ["o"],
                        "int i = int(thread_position_in_grid.x); o[i] = x[i - 3];")
    with pytest.raises(em.EmulatorFault, match=r"out-of-bounds read .*'x'.*element index -\d"):
        k(inputs=[rand((64,))], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])


def test_out_of_bounds_threadgroup_access_flagged():
    k = em.metal_kernel(
        "oob_tg", ["x"], ["o"],
        """
        threadgroup float tile[32];
        uint t = thread_index_in_threadgroup;
        tile[t + 1] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        o[thread_position_in_grid.x] = tile[t];
        """,
    )
    with pytest.raises(em.EmulatorFault,
                       match=r"out-of-bounds write of threadgroup memory 'threadgroup float "
                             r"tile\[32\]'.*element index 32"):
        k(inputs=[rand((64,))], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])


def test_uninitialised_threadgroup_read_is_reported():
    k = em.metal_kernel(
        "tg_uninit", ["x"], ["o"],
        """
        threadgroup float tile[64];
        uint t = thread_index_in_threadgroup;
        tile[t] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        o[thread_position_in_grid.x] = tile[t + 32];  // half of it was never written
        """,
    )
    with pytest.raises(em.EmulatorFault, match="uninitialised threadgroup memory"):
        k(inputs=[rand((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_divergent_barrier_reported_not_hung():
    k = em.metal_kernel(
        "early_exit", ["x"], ["o"],
        """
        uint t = thread_index_in_threadgroup;
        if (t >= 40) return;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        o[thread_position_in_grid.x] = x[t];
        """,
    )
    with pytest.raises(em.EmulatorFault,
                       match=r"barrier reached by only part of a threadgroup.*returned.*40-63"):
        k(inputs=[rand((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])


def test_barrier_in_one_branch_reported():
    k = em.metal_kernel(
        "branch_barrier", ["x"], ["o"],
        """
        uint t = thread_index_in_threadgroup;
        if (t % 2 == 0) {
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        o[thread_position_in_grid.x] = x[t];
        """,
    )
    with pytest.raises(em.EmulatorFault, match="barrier reached by only part"):
        k(inputs=[rand((64,))], grid=(64, 1, 1), threadgroup=(64, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])


def test_integer_division_by_zero_reported():
    k = em.metal_kernel("divzero", ["x", "d"], ["o"],
                        "uint i = thread_position_in_grid.x; o[i] = x[i] / d;")
    with pytest.raises(em.EmulatorFault, match="division by zero"):
        k(inputs=[mx.arange(8).astype(mx.int32), 0], grid=(8, 1, 1), threadgroup=(8, 1, 1),
          output_shapes=[(8,)], output_dtypes=[mx.int32])


def test_checks_env_switch(monkeypatch):
    from mlx_bricks.emulator import _checks_from_env

    monkeypatch.setenv("MLX_BRICKS_EMULATOR_CHECKS", "0")
    c = _checks_from_env()
    assert (c.bounds, c.unwritten, c.schedules) == (False, False, 1)
    monkeypatch.setenv("MLX_BRICKS_EMULATOR_CHECKS", "1")
    c = _checks_from_env()
    assert (c.bounds, c.unwritten, c.schedules) == (True, True, 2)


# ---------------------------------------------------------------------------------------------
# compile-time checks


def test_address_space_mismatch_rejected():
    header = "inline void store_one(device float* p, float v) { p[0] = v; }\n"
    k = em.metal_kernel(
        "as_mismatch", ["x"], ["o"],
        """
        threadgroup float tile[32];
        store_one(tile, x[0]);   // a threadgroup pointer where a device one is expected
        o[thread_position_in_grid.x] = tile[0];
        """,
        header=header,
    )
    with pytest.raises(em.EmulatorCompileError,
                       match=r"(?s)'threadgroup float\[32\]' to 'device float \*'.*"
                             r"address spaces are distinct"):
        k(inputs=[rand((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_unsupported_feature_is_a_compile_error_naming_it():
    k = em.metal_kernel("unsupported", ["x"], ["o"],
                        "o[thread_position_in_grid.x] = simd_shuffle_rotate_down(x[0], 1);")
    with pytest.raises(em.EmulatorCompileError, match="simd_shuffle_rotate_down"):
        k(inputs=[rand((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])
    k2 = em.metal_kernel("unsupported_mat", ["x"], ["o"],
                         "simdgroup_matrix<float, 4, 4> m; o[thread_position_in_grid.x] = 0;")
    with pytest.raises(em.EmulatorCompileError, match=r"only simdgroup_matrix<T, 8, 8>"):
        k2(inputs=[rand((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
           output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_malformed_mlx_signature_refused():
    k = em.metal_kernel("two_out_shape", ["x"], ["o", "p"],
                        "o[0] = x_shape[0]; p[0] = 1;")
    with pytest.raises(em.EmulatorCompileError, match="malformed signature"):
        k(inputs=[rand((32,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
          output_shapes=[(1,), (1,)], output_dtypes=[mx.float32, mx.float32])


STRIDED = """
uint2 p = thread_position_in_grid.xy;   // (column, row) of the view
if (p.x < uint(x_shape[1]) && p.y < uint(x_shape[0]))
  o[p.y * x_shape[1] + p.x] = x[p.y * x_strides[0] + p.x * x_strides[1]];
"""


@pytest.mark.parametrize("row_contiguous", [True, False])
def test_strided_view_inputs(row_contiguous):
    """ensure_row_contiguous=False hands the kernel the view itself (its strides), as MLX does;
    True hands it a row-contiguous copy."""
    k = em.metal_kernel(f"strided_{int(row_contiguous)}", ["x"], ["o", "s"],
                        STRIDED + "if (p.x == 0 && p.y == 0) { s[0] = x_strides[0]; s[1] = x_strides[1]; }",
                        ensure_row_contiguous=row_contiguous)
    base = mx.arange(6 * 10).astype(mx.bfloat16).reshape(6, 10)
    view = base[1:5, 2:9].T  # (7, 4), strides (1, 10)
    o, s = k(inputs=[view], grid=(4, 7, 1), threadgroup=(4, 4, 1),
             output_shapes=[(7, 4), (2,)], output_dtypes=[mx.bfloat16, mx.int64])
    np.testing.assert_array_equal(as_f64(o), as_f64(view))
    assert np.array(s).tolist() == ([4, 1] if row_contiguous else [1, 10])


def test_threadgroup_atomics_and_bfloat_vectors():
    k = em.metal_kernel(
        "tg_atomic", ["x"], ["o"],
        """
        threadgroup atomic<int> counter;
        uint t = thread_index_in_threadgroup;
        if (t == 0) atomic_store_explicit(&counter, 0, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        atomic_fetch_add_explicit(&counter, 1, memory_order_relaxed);
        bfloat4 b = bfloat4(x[thread_position_in_grid.x]);
        b = b * b + bfloat4(1.0f);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        o[thread_position_in_grid.x] = float4(b).w + atomic_load_explicit(&counter, memory_order_relaxed);
        """,
    )
    x = mx.arange(100).astype(mx.float32) / 8
    (o,) = k(inputs=[x], grid=(100, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(100,)],
             output_dtypes=[mx.float32])
    xb = np.array(x.astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    sq = np.array(mx.array(xb * xb, dtype=mx.float32).astype(mx.bfloat16).astype(mx.float32))
    want = np.array(mx.array(sq + 1.0).astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    want += np.where(np.arange(100) < 64, 64, 36)
    np.testing.assert_array_equal(np.array(o).astype(np.float64), want)


def test_thread_stack_overflow_reported():
    k = em.metal_kernel(
        "big_stack", ["x"], ["o"],
        """
        float big[100000];   // 400 KB of thread memory: more than a fiber's stack
        uint i = thread_position_in_grid.x;
        for (int j = 0; j < 100000; ++j) big[j] = x[i] + j;
        o[i] = big[int(x[i]) % 100000];
        """,
    )
    with pytest.raises(em.EmulatorFault, match="thread stack overflow"):
        k(inputs=[mx.ones((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])
