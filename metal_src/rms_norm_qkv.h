// rms_norm_qkv.h -- the per-projection part of the fused RMSNorm + Q/K/V kernel, on gemm.h.
//
//   QkvProjection       one BM x BN tile of one projection: binds the projection's weight loader
//                       (float or affine-quantized: the loader type follows the operand), runs
//                       gemm_k_loop with the RMSNorm transform on x, writes the head layout.
//   for_projection      calls it with the threadgroup's projection (q, k or v). When the three
//                       weight operands share one type the operand is selected first and the
//                       tile code is instantiated once; otherwise once per format.
//
// Concatenated after gemm.h by the kernel registry (headers = gemm.h, rms_norm_qkv.h).

#ifndef MLX_BRICKS_RMS_NORM_QKV_H
#define MLX_BRICKS_RMS_NORM_QKV_H

#include <metal_stdlib>
#include <metal_simdgroup_matrix>

using namespace metal;

namespace bricks {

template <typename T, short BM, short BN, short BK, short WM, short WN, short LDA, short LDB,
          short STAGES, bool SCHED, short HEAD_DIM, bool HAS_BIAS, bool ALIGN_MN,
          typename LoaderA, typename Norm>
struct QkvProjection {
  static constant constexpr short NT = WM * WN * 32;
  typedef SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB, SCHED> MMA;

  thread LoaderA* la;       // x rows of this tile, bound by the kernel
  thread const Norm* norm;  // the RMSNorm transform applied to x chunks
  threadgroup T* As;
  threadgroup T* Bs;
  int m0;
  int n0;                   // first column of the tile inside its projection
  int M;
  int K;
  int L;
  bool vec;                 // the kernel's VEC (dense weights: 128-bit loads)
  ushort tid;
  ushort sg;
  ushort lane;

  // weight: (N, K) operand (DenseWeight or AffineWeight); bias: (N,) (a placeholder without
  // HAS_BIAS); out: (B, H, L, HEAD_DIM) with N = H * HEAD_DIM.
  template <typename W, typename BPtr>
  void operator()(W weight, BPtr bias, device T* out, int H, int N) {
    typedef typename W::template Loader<T, BN, BK, LDB, NT> LoaderB;
    LoaderB lb(tid, K);
    bind_weight_rows(lb, weight, n0, N, K, vec);
    MMA mma(sg, lane);
    gemm_k_loop<BK, STAGES>(*la, lb, mma, As, Bs, K, *norm);

    // Output column n = h * HEAD_DIM + d of row m = b * L + l goes to
    // out[((b * H + h) * L + l) * HEAD_DIM + d].
    const bool full = ALIGN_MN || (m0 + BM <= M && n0 + BN <= N);
    BRICKS_UNROLL
    for (short i = 0; i < MMA::TM; ++i) {
      const int r = mma.row0 + i * 8;
      if (!full && m0 + r >= M) continue;
      const int b = (m0 + r) / L;
      const int l = (m0 + r) - b * L;
      const long row_base = (long(b) * H * L + l) * HEAD_DIM;
      BRICKS_UNROLL
      for (short j = 0; j < MMA::TN; ++j) {
        thread auto& e = mma.acc[i][j].thread_elements();
        BRICKS_UNROLL
        for (short t = 0; t < 2; ++t) {
          const int n = n0 + mma.col0 + j * 8 + t;
          if (!full && n >= N) continue;
          const int h = n / HEAD_DIM;
          const int d = n - h * HEAD_DIM;
          float val = e[t];
          if (HAS_BIAS) val += float(bias[n]);
          out[row_base + long(h) * L * HEAD_DIM + d] = T(val);
        }
      }
    }
  }
};

// q, k and v weights of different formats: one instantiation of the tile per format.
template <typename F, typename WQ, typename WK, typename WV, typename BPtr, typename OPtr>
void for_projection(thread F& f, int proj, WQ wq, WK wk, WV wv, BPtr bq, BPtr bk,
                    BPtr bv, OPtr q, OPtr k, OPtr v, int n_heads, int n_kv_heads, int nq,
                    int nkv) {
  if (proj == 0) {
    f(wq, bq, q, n_heads, nq);
  } else if (proj == 1) {
    f(wk, bk, k, n_kv_heads, nkv);
  } else {
    f(wv, bv, v, n_kv_heads, nkv);
  }
}

// One format for all three (the common case): select the operand, instantiate the tile once.
template <typename F, typename W, typename BPtr, typename OPtr>
void for_projection(thread F& f, int proj, W wq, W wk, W wv, BPtr bq, BPtr bk, BPtr bv,
                    OPtr q, OPtr k, OPtr v, int n_heads, int n_kv_heads, int nq, int nkv) {
  const bool is_q = proj == 0;
  f(is_q ? wq : (proj == 1 ? wk : wv), is_q ? bq : (proj == 1 ? bk : bv),
    is_q ? q : (proj == 1 ? k : v), is_q ? n_heads : n_kv_heads, is_q ? nq : nkv);
}

}  // namespace bricks

#endif  // MLX_BRICKS_RMS_NORM_QKV_H
