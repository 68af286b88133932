// moe.cuh -- the CUDA twin of metal_src/moe.h: the MoE brick's pieces on gemm.cuh's pipeline.
// Needs mma.cuh and gemm.cuh before it (the GEMM bodies); the route kernel needs nothing.
//
//   route_tile            a block's (expert, first row, end row) from the route array (layout in
//                         metal_src/moe.h: offsets[E + 2], tile_expert[TILES], tile_m0[TILES]).
//   expert_operand        the (w, scales, biases) pointers of expert e of a stacked weight.
//   GatherALoader         gemm.cuh's ALoader over gathered rows: sorted row m reads token
//                         order[m] / top_k of x (row pointers computed once per block).
//   MoeGateUpOut          gate/up epilogue: act(gate + b_gate, up + b_up) from the fused block's
//                         two operands (MODE 0), or the split pair for gate and up of different
//                         formats: up + b_up (MODE 1), then act(gate + b_gate, up) (MODE 2).
//   ScatterOut            down epilogue: sorted row -> its (token, slot) row, + the bias.
//   fill_nan_rows         the rows of out-of-range indices (the op's index check off).
#ifndef MLX_BRICKS_MOE_CUH
#define MLX_BRICKS_MOE_CUH

namespace bricks {

struct RouteTile {
  int expert;   // 0 .. E - 1; E: the out-of-range tail; -1: no tile
  int m0;       // first sorted row
  int row_end;  // end of the expert's rows
};

__device__ __forceinline__ RouteTile route_tile(const int32_t* route, int E, int tiles, int t) {
  RouteTile r;
  r.expert = route[E + 2 + t];
  r.m0 = route[E + 2 + tiles + t];
  r.row_end = r.expert >= 0 ? route[r.expert + 1] : 0;
  return r;
}

#ifdef MLX_BRICKS_GEMM_CUH

// The MoE kernels' ACT values: gemm.cuh's two, gpt-oss's clamped SwiGLU and Kimi K3's SiTU. The
// parametrised ones read two floats (act_params): (alpha, limit) / (beta, linear_beta).
constexpr int ACT_SWIGLU_OAI = 2;
constexpr int ACT_SITU = 3;
// A gate-less expert's (SwitchMLP: fc1, activation, fc2) activation of up: ReLU^2 (MODE 3).
constexpr int ACT_RELU2 = 4;

// gpt-oss (mlx_lm.models.activations.swiglu_oai), as metal_src/moe.h: g' = min(g, limit),
// u' = clip(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha * g'), the sigmoid from exp(-|z|).
__device__ __forceinline__ float swiglu_oai(float g, float u, float alpha, float limit) {
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  const float z = alpha * g;
  const float e = expf(-fabsf(z));
  const float sig = z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return (u + 1.0f) * (g * sig);
}

// Kimi K3's SiTU (mlx_lm.models.kimi_k3._situ), as metal_src/moe.h: beta tanh(g / beta)
// sigmoid(g) times u, u first squashed to linear_beta tanh(u / linear_beta) when linear_beta > 0.
__device__ __forceinline__ float situ(float g, float u, float beta, float linear_beta) {
  const float e = expf(-fabsf(g));
  const float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  const float a = beta * tanhf(g / beta) * sig;  // tanhf: +-1 at +-inf, NaN kept
  if (linear_beta > 0.0f) u = linear_beta * tanhf(u / linear_beta);
  return a * u;
}

// A gate-less expert's activation of up (nemotron_h's nn.ReLU2: relu(u)^2), NaN kept.
template <int ACT>
__device__ __forceinline__ float moe_activation_up(float u) {
  static_assert(ACT == ACT_RELU2, "a gate-less expert's ACT must be 4 (ReLU^2)");
  return u > 0.0f ? u * u : (u <= 0.0f ? 0.0f : u);  // NaN fails both: kept
}

// act(g, u) with the activation's two parameters p0, p1 (act_params; unused by SiLU / GELU).
template <int ACT>
__device__ __forceinline__ float moe_activation(float g, float u, float p0, float p1) {
  static_assert(ACT == ACT_SILU || ACT == ACT_GELU_TANH || ACT == ACT_SWIGLU_OAI ||
                    ACT == ACT_SITU,
                "ACT must be 0 (SiLU), 1 (GELU-tanh), 2 (gpt-oss clamped SwiGLU) or 3 (SiTU)");
  if constexpr (ACT == ACT_SWIGLU_OAI) {
    return swiglu_oai(g, u, p0, p1);
  } else if constexpr (ACT == ACT_SITU) {
    return situ(g, u, p0, p1);
  } else {
    return activation<ACT>(g) * u;
  }
}

// Expert e of a stacked (E, N, K) weight given as the kernels take it (w of T for a float
// weight, uint32 packed for affine; scales / biases (E, N, K / GS) of T, placeholders for a
// float weight and then not offset).
template <int BITS, int GS, typename T>
__device__ __forceinline__ void expert_operand(const void* w, const T* s, const T* b, int e,
                                               int N, int K, const void*& w_e, const T*& s_e,
                                               const T*& b_e) {
  const long w_bytes = BITS == 0 ? long(N) * K * long(sizeof(T)) : long(N) * (K / 8 * BITS);
  w_e = static_cast<const unsigned char*>(w) + e * w_bytes;
  const long so = BITS == 0 ? 0 : long(e) * N * (K / (GS > 0 ? GS : 1));
  s_e = s + so;
  b_e = b + so;
}

// gemm.cuh's ALoader for gathered rows: chunk j of this thread reads sorted row m0 + r (r its
// tile row), that is token order[m0 + r] / top_k of x (tokens, K) row-contiguous; rows at or past
// row_end are zero-filled (computed, never stored). The row pointers are computed once.
template <class Cfg>
struct GatherALoader {
  using T = typename Cfg::T;
  static constexpr int PER_THREAD = Cfg::BM * GEMM_CHUNKS / Cfg::THREADS;
  const T* rows[PER_THREAD];
  unsigned live;  // bit j: chunk j's row is one of the expert's
  int K;
  bool vec;  // 16-byte cp.async: K % 8 == 0 and a 16-byte aligned base

  __device__ GatherALoader(const T* x, const uint32_t* order, int top_k, int K_, int m0,
                           int row_end, int tid)
      : live(0), K(K_) {
    vec = (K % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int m = m0 + (tid + j * Cfg::THREADS) / GEMM_CHUNKS;
      const int row = min(m, row_end - 1);
      rows[j] = x + long(order[row] / unsigned(top_k)) * K;
      live |= unsigned(m < row_end) << j;
    }
  }

  __device__ __forceinline__ void issue(unsigned char* stage, int k0, int tid) const {
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int id = tid + j * Cfg::THREADS;
      const int r = id / GEMM_CHUNKS;
      const int c = id % GEMM_CHUNKS;
      const int k = k0 + c * 8;
      const bool row_ok = (live >> j) & 1u;
      unsigned char* dst = stage + swz(r, c);
      if (vec) {
        const bool ok = row_ok && k < K;
        cp_async16(smem_addr(dst), rows[j] + (ok ? k : 0), ok);
      } else {
        *reinterpret_cast<uint4*>(dst) = load8_checked(rows[j], k, row_ok ? K : 0);
      }
    }
  }
};

// MODE 0: act = act(gate + b_gate, up + b_up) from the fused block (v[0] gate, v[1] up).
// MODE 1: up = up + b_up (rounded to T, as stock rounds it). MODE 2: act = act(gate + b_gate,
// up[row, col]). MODE 3 (a gate-less expert): act = act1(up + b_up). Rows of act / up: sorted
// rows < row_end. Bias pointers: the expert's (N,) rows.
template <typename T, int MODE, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, int ACT>
struct MoeGateUpOut {
  T* act;
  const T* b_gate;
  const T* b_up;
  const T* up;  // MODE 2 only
  int row_end, N, m0, n0;
  float alpha, limit;  // act_params (SiTU: beta, linear_beta)

  template <int NB>
  __device__ __forceinline__ void operator()(const float (&v)[NB][2], int r, int c) const {
    const int row = m0 + r;
    const int col = n0 + c;
    if (row >= row_end || col >= N) return;
    const int c1 = min(col + 1, N - 1);  // a clamped column is never stored
    float out[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = e == 0 ? col : c1;
      if constexpr (MODE == 1) {
        out[e] = v[0][e] + (HAS_BIAS_UP ? to_float(b_up[n]) : 0.0f);
      } else if constexpr (MODE == 3) {
        out[e] = moe_activation_up<ACT>(v[0][e] + (HAS_BIAS_UP ? to_float(b_up[n]) : 0.0f));
      } else {
        const float g = v[0][e] + (HAS_BIAS_GATE ? to_float(b_gate[n]) : 0.0f);
        float u;
        if constexpr (MODE == 0) {
          u = v[NB - 1][e] + (HAS_BIAS_UP ? to_float(b_up[n]) : 0.0f);
        } else {
          u = to_float(up[long(row) * N + n]);
        }
        out[e] = moe_activation<ACT>(g, u, alpha, limit);
      }
    }
    RowMajor<T>{act, N}.store(row, col, col + 1 < N, make_float2(out[0], out[1]));
  }
};

// y[order[row]] = acc + bias (the expert's (D,) row), sorted rows < row_end, columns < D.
template <typename T, bool HAS_BIAS>
struct ScatterOut {
  T* y;
  const T* bias;
  const uint32_t* order;
  int row_end, D, m0, n0, R;

  __device__ __forceinline__ void operator()(const float (&v)[1][2], int r, int c) const {
    const int row = m0 + r;
    const int col = n0 + c;
    if (row >= row_end || col >= D) return;
    float a0 = v[0][0];
    float a1 = v[0][1];
    if constexpr (HAS_BIAS) {
      a0 += to_float(bias[col]);
      if (col + 1 < D) a1 += to_float(bias[col + 1]);
    }
    RowMajor<T>{y, D}.store(int(order[row]), col, col + 1 < D, make_float2(a0, a1));
  }
};

// Sorted rows [m0, m0 + rows), columns [n0, n0 + BN) of an (R, N) output are quiet NaN: output
// row order[row] when SCATTER (the down projection), else row.
template <bool SCATTER, int BN, typename T>
__device__ __forceinline__ void fill_nan_rows(T* out, const uint32_t* order, int m0, int rows,
                                              int n0, int N, int tid, int nthreads) {
  const int cols = min(BN, N - n0);
  const T nan = from_float<T>(__uint_as_float(0x7fc00000u));
  for (int i = tid; i < rows * cols; i += nthreads) {
    const int row = m0 + i / cols;
    const long dst = SCATTER ? long(order[row]) : long(row);
    out[dst * N + n0 + i % cols] = nan;
  }
}

#endif  // MLX_BRICKS_GEMM_CUH

}  // namespace bricks

#endif  // MLX_BRICKS_MOE_CUH
