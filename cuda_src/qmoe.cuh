// qmoe.cuh -- the MoE brick's grouped GEMMs on qgemm.cuh's pipeline (weights dequantized in
// registers): one block is one (expert, row tile) of the route (moe.cuh route_tile) by one
// column tile, n tiles fastest, as the moe twins order them. Needs qgemm.cuh, qgemm_ops.cuh
// and moe.cuh before it.
//
//   QMoeGateUp      act(gate + b_gate, up + b_up) with the MoE activations (SiLU, GELU-tanh,
//                   gpt-oss's clamped SwiGLU, SiTU: moe.cuh moe_activation), operands 0 / 1
//   qmoe_block      the route lookup, the NaN rows of out-of-range indices (the op's index
//                   check off), the expert's weights, then qgemm_tile over gathered rows (gate /
//                   up: QRows<GATHER>) or into scattered rows (down: QRows<SCATTER>)
#ifndef MLX_BRICKS_QMOE_CUH
#define MLX_BRICKS_QMOE_CUH

namespace bricks {

template <typename T, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, int ACT>
struct QMoeGateUp {
  const T* b_gate;  // the expert's (N,) rows
  const T* b_up;
  float alpha, limit;  // act_params (SiTU: beta, linear_beta)

  __device__ __forceinline__ void operator()(const float (&v)[2][8], long, int col, int nv,
                                             float (&o)[8]) const {
    float bg[8], bu[8];
    gate_up_biases<HAS_BIAS_GATE, HAS_BIAS_UP>(b_gate, b_up, col, nv, bg, bu);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = moe_activation<ACT>(v[0][e] + bg[e], v[1][e] + bu[e], alpha, limit);
  }
};

// One block of a grouped GEMM: x (rows of K), the NB stacked weights w[b] (E, N, K) with their
// scales / biases, output out (rows of N). GATHER: x rows are tokens (order[m] / top_k);
// SCATTER: output rows are order[m]. make_op(expert) gives the epilogue op of the block's expert.
template <class C, bool WGMMA, int MI, int WR, int DEPTH, bool GATHER, bool SCATTER, class MakeOp>
__device__ __forceinline__ void qmoe_block(unsigned char* smem, const typename C::T* x, int K,
                                           const uint32_t* order, int top_k, const int32_t* route,
                                           int E, int tiles, int N,
                                           const void* const (&w)[C::NB],
                                           const typename C::T* const (&s)[C::NB],
                                           const typename C::T* const (&b)[C::NB],
                                           const MakeOp& make_op, typename C::T* out) {
  const int n_tiles = (N + C::OUT_N - 1) / C::OUT_N;
  const int tn = int(blockIdx.x) % n_tiles;
  const RouteTile rt = route_tile(route, E, tiles, int(blockIdx.x) / n_tiles);
  if (rt.expert < 0) return;  // past the last row tile: the whole block returns
  if (rt.expert == E) {
    fill_nan_rows<SCATTER, C::OUT_N>(out, order, rt.m0, min(C::BM, rt.row_end - rt.m0),
                                     tn * C::OUT_N, N, int(threadIdx.x), kQThreads);
    return;
  }
  const void* we[C::NB];
  const typename C::T* se[C::NB];
  const typename C::T* be[C::NB];
#pragma unroll
  for (int i = 0; i < C::NB; ++i) {
    expert_operand<C::BITS, C::GS>(w[i], s[i], b[i], rt.expert, N, K, we[i], se[i], be[i]);
  }
  const QRows<typename C::T, GATHER, SCATTER> map{x, order, top_k, rt.row_end, K, rt.m0};
  qgemm_tile<C, WGMMA, MI, WR, DEPTH>(smem, map, N, tn * C::OUT_N, we, se, be,
                                      make_op(rt.expert), out);
}

}  // namespace bricks

#endif  // MLX_BRICKS_QMOE_CUH
