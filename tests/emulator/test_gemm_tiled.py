"""A tiled simdgroup_matrix GEMM (64x64 tiles, 4 SIMD-groups of 32x32) through the emulator.

The kernel lives here, not in metal_src: it is a workload for the emulator, not a brick.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em

GEMM = """
constexpr int BM = 64, BN = 64;
threadgroup T As[BM * BK];
threadgroup T Bs[BK * BN];
uint tid = thread_index_in_threadgroup;
uint sg = simdgroup_index_in_threadgroup;
uint sm = sg / 2, sn = sg % 2;
uint row0 = threadgroup_position_in_grid.y * BM, col0 = threadgroup_position_in_grid.x * BN;
simdgroup_matrix<float, 8, 8> acc[4][4];
for (int i = 0; i < 4; ++i)
  for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
for (int k0 = 0; k0 < K; k0 += BK) {
  for (uint e = tid; e < BM * BK; e += 128) {
    uint r = e / BK, c = e % BK, gr = row0 + r, gc = k0 + c;
    As[e] = (gr < uint(M) && gc < uint(K)) ? A[gr * K + gc] : T(0);
  }
  for (uint e = tid; e < BK * BN; e += 128) {
    uint r = e / BN, c = e % BN, gr = k0 + r, gc = col0 + c;
    Bs[e] = (gr < uint(K) && gc < uint(N)) ? B[gr * N + gc] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int kk = 0; kk < BK; kk += 8) {
    simdgroup_matrix<T, 8, 8> a[4], b[4];
    for (int i = 0; i < 4; ++i) simdgroup_load(a[i], As + (sm * 32 + i * 8) * BK + kk, BK);
    for (int j = 0; j < 4; ++j) simdgroup_load(b[j], Bs + kk * BN + sn * 32 + j * 8, BN);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
uint lane = thread_index_in_simdgroup;
uint qid = lane / 4;
uint fr = (qid & 4) + (lane / 2) % 4, fc = (qid & 2) * 2 + (lane % 2) * 2;
for (int i = 0; i < 4; ++i)
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 2; ++e) {
      uint r = row0 + sm * 32 + i * 8 + fr, c = col0 + sn * 32 + j * 8 + fc + e;
      if (r < uint(M) && c < uint(N)) C[r * N + c] = T(acc[i][j].thread_elements()[e]);
    }
"""


def run_gemm(M, N, K, bk, dtype=mx.float16, seed=0):
    k = em.metal_kernel("emu_test_gemm", ["A", "B", "M", "N", "K"], ["C"], GEMM)
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((K, N)).astype(np.float32)).astype(dtype)
    (c,) = k(inputs=[a, b, M, N, K], grid=((N + 63) // 64 * 128, (M + 63) // 64, 1),
             threadgroup=(128, 1, 1), output_shapes=[(M, N)], output_dtypes=[dtype],
             template=[("T", dtype), ("BK", bk)])
    f64 = lambda x: np.array(x.astype(mx.float32)).astype(np.float64)  # noqa: E731
    return f64(c), f64(a) @ f64(b)


@pytest.mark.parametrize("bk", [16, 32])
def test_gemm_256_matches_numpy(bk):
    # The speed target (under 5 s on 2 cores) is measured by `python -m mlx_bricks.bench`
    # (emulator_gemm_256), not asserted here.
    got, want = run_gemm(256, 256, 256, bk)
    # fp16 output of a float accumulation: within a couple of fp16 ulps of the exact product
    np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-10 * np.abs(want).max())


def test_gemm_ragged_edges():
    got, want = run_gemm(70, 100, 40, 16, seed=1)
    np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-10 * np.abs(want).max())


def test_gemm_bfloat16():
    got, want = run_gemm(64, 128, 64, 32, dtype=mx.bfloat16, seed=2)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * np.abs(want).max())
