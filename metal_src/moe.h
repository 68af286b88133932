// moe.h -- the MoE MLP brick (grouped GEMM over experts) as a thin layer on gemm.h and swiglu.h.
// Concatenated after them by the kernel registry (headers = gemm.h, swiglu.h, moe.h).
//
// Rows are the (token, slot) pairs of the router's top-k, R = tokens * top_k of them, sorted by
// expert (order = argsort(indices)); the moe_route kernel turns the sorted rows into the
// `route` array every GEMM threadgroup reads (no host sync):
//
//   route[0 .. E + 1]                       offsets: rows of expert e are sorted rows
//                                           [offsets[e], offsets[e + 1]); e = E is the tail of
//                                           rows whose index is out of range (>= E), normally
//                                           empty; offsets[E + 1] = R.
//   route[E + 2 + t], t < TILES             tile_expert: expert of row tile t, -1 past the last
//   route[E + 2 + TILES + t]                tile_m0: first sorted row of tile t
//
// Each row tile belongs to one expert; the grid has TILES = plan_moe's upper bound of row
// tiles and threadgroups past the real count return at once.
//
//   route_tile                  a threadgroup's (expert, first row, end row) from route.
//   moe_activation<ACT>         act(gate, up): SiLU / GELU-tanh (swiglu.h), gpt-oss's
//                               clamped SwiGLU (ACT_SWIGLU_OAI, alpha and limit) and Kimi K3's
//                               SiTU (ACT_SITU, beta and linear_beta).
//   moe_gate_up_combine         gate acc <- act(gate + b_gate, up + b_up) in registers.
//   UpActEpilogue               a gate-less expert's (SwitchMLP) act1(up + b_up): ReLU^2.
//   StackedLoader               two weight loaders staged as one B tile (gate rows, then up
//                               rows): gate and up in different formats, gemm_k_loop unchanged.
//   GateUpLoaderOf              the gate/up weight loader: one loader of 2 BN rows when both
//                               have one format (as the fused SwiGLU), else a StackedLoader.
//   ExpertStride, expert_weight the operand of expert e of a stacked (E, N, K) weight.
//   bind_gathered_rows          points the x loader at the tokens of sorted rows.
//   scatter_store               down epilogue: sorted row -> its (token, slot) row, + bias.
//   fill_nan_rows               the rows of out-of-range indices.

#ifndef MLX_BRICKS_MOE_H
#define MLX_BRICKS_MOE_H

#include <metal_stdlib>
#include <metal_simdgroup_matrix>

using namespace metal;

namespace bricks {

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

struct RouteTile {
  int expert;   // 0 .. E - 1; E for the out-of-range tail; -1: no tile (return)
  int m0;       // first sorted row of the tile
  int row_end;  // end of the expert's rows (the tile holds rows m0 .. min(m0 + BM, row_end))
};

// Tile t of a route array with E experts and `tiles` row tiles.
template <typename RPtr>
inline RouteTile route_tile(RPtr route, int E, int tiles, int t) {
  RouteTile r;
  r.expert = route[E + 2 + t];
  r.m0 = route[E + 2 + tiles + t];
  r.row_end = r.expert >= 0 ? route[r.expert + 1] : 0;
  return r;
}

// Elements between consecutive experts of a stacked (E, N, K) weight in its format: the float
// array itself (BITS = 0), or the packed words (w) and the scales / biases (s) of MLX affine.
template <short BITS, short GROUP_SIZE>
struct ExpertStride {
  static long w(int N, int K) { return BITS == 0 ? long(N) * K : long(N) * (K / 32 * BITS); }
  static long s(int N, int K) { return BITS == 0 ? 0 : long(N) * (K / max(int(GROUP_SIZE), 1)); }
};

// The operand of expert e of a stacked weight (w, scales, biases as the kernel gets them;
// scales and biases are placeholders for a float weight and are not offset).
template <short BITS, short GROUP_SIZE, typename WPtr, typename SPtr, typename BPtr>
typename WeightOf<BITS, GROUP_SIZE, WPtr, SPtr, BPtr>::type expert_weight(
    WPtr w, SPtr scales, BPtr biases, int e, int N, int K) {
  typedef ExpertStride<BITS, GROUP_SIZE> S;
  const long so = BITS == 0 ? 0 : e * S::s(N, K);
  return WeightOf<BITS, GROUP_SIZE, WPtr, SPtr, BPtr>::make(w + e * S::w(N, K), scales + so,
                                                            biases + so);
}

// ---------------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------------

// The MoE kernels' ACT values: swiglu.h's two, gpt-oss's clamped SwiGLU and Kimi K3's SiTU.
// The parametrised ones read two floats (act_params): (alpha, limit) / (beta, linear_beta).
// ACT_RELU2 is a gate-less expert's (SwitchMLP: fc1, activation, fc2; moe_up.metal).
enum MoeActivation : int { ACT_SWIGLU_OAI = 2, ACT_SITU = 3, ACT_RELU2 = 4 };

// A gate-less expert's activation of up (nemotron_h's nn.ReLU2: relu(u)^2), NaN kept.
template <int ACT>
inline float moe_activation_up(float u) {
  static_assert(ACT == ACT_RELU2, "a gate-less expert's ACT must be 4 (ReLU^2)");
  return u > 0.0f ? u * u : (u <= 0.0f ? 0.0f : u);  // NaN fails both: kept
}

// Store op of moe_up.metal: act1(acc + b_up[col]) in float, rounded once by the store. Only
// called for stored (in-bounds) elements.
template <int ACT, bool HAS_BIAS, typename BiasPtr>
struct UpActEpilogue {
  BiasPtr bias;  // the expert's bias row at the block's first column (a placeholder: unread)
  float operator()(float v, short, short c) const {
    return moe_activation_up<ACT>(v + (HAS_BIAS ? float(bias[c]) : 0.0f));
  }
};

// gpt-oss (mlx_lm.models.activations.swiglu_oai): g' = min(g, limit), u' = clip(u, -limit,
// limit), (u' + 1) * g' * sigmoid(alpha * g'). The sigmoid is formed from exp(-|z|) so it never
// overflows (as swiglu.h's SiLU).
inline float swiglu_oai(float g, float u, float alpha, float limit) {
  g = min(g, limit);
  u = clamp(u, -limit, limit);
  const float z = alpha * g;
  const float e = precise::exp(-fabs(z));  // in [0, 1]
  const float sig = z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return (u + 1.0f) * (g * sig);
}

// Kimi K3's SiTU (mlx_lm.models.kimi_k3._situ): beta tanh(g / beta) sigmoid(g) times u, u first
// squashed to linear_beta tanh(u / linear_beta) when linear_beta > 0 (0: the model has none).
// precise::tanh is exact at +-inf (+-1) and keeps a NaN, as mlx-lm's; the sigmoid from
// exp(-|g|) as above.
inline float situ(float g, float u, float beta, float linear_beta) {
  const float e = precise::exp(-fabs(g));  // in [0, 1]
  const float sig = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  const float a = beta * precise::tanh(g / beta) * sig;
  if (linear_beta > 0.0f) u = linear_beta * precise::tanh(u / linear_beta);
  return a * u;
}

// act(g, u) with the activation's two parameters p0, p1 (act_params; unused by SiLU / GELU).
template <int ACT>
inline float moe_activation(float g, float u, float p0, float p1) {
  static_assert(ACT == ACT_SILU || ACT == ACT_GELU_TANH || ACT == ACT_SWIGLU_OAI ||
                    ACT == ACT_SITU,
                "ACT must be 0 (SiLU), 1 (GELU-tanh), 2 (gpt-oss clamped SwiGLU) or 3 (SiTU)");
  if (ACT == ACT_SWIGLU_OAI) return swiglu_oai(g, u, p0, p1);
  if (ACT == ACT_SITU) return situ(g, u, p0, p1);
  return swiglu_value<ACT == ACT_GELU_TANH ? ACT_GELU_TANH : ACT_SILU>(g, u);
}

// mma.gate.acc <- act(gate + b_gate, up + b_up) elementwise in float registers (the expert's
// (N,) bias rows; placeholders when absent, never read); columns past N clamp to N - 1 so edge
// tiles read in bounds (never stored). As swiglu_combine, with the MoE activations.
template <int ACT, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, typename MMA, typename GPtr,
          typename UPtr>
void moe_gate_up_combine(thread MMA& mma, GPtr b_gate, UPtr b_up, int n0, int N, float p0,
                         float p1) {
  BRICKS_UNROLL
  for (short i = 0; i < MMA::Block::TM; ++i) {
    BRICKS_UNROLL
    for (short j = 0; j < MMA::Block::TN; ++j) {
      const int c = n0 + mma.gate.col0 + j * 8;
      thread auto& g = mma.gate.acc[i][j].thread_elements();
      thread auto& u = mma.up.acc[i][j].thread_elements();
      BRICKS_UNROLL
      for (short e = 0; e < 2; ++e) {
        const int n = min(c + e, N - 1);
        float gv = g[e];
        float uv = u[e];
        if (HAS_BIAS_GATE) gv += float(b_gate[n]);
        if (HAS_BIAS_UP) uv += float(b_up[n]);
        g[e] = moe_activation<ACT>(gv, uv, p0, p1);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Loaders
// ---------------------------------------------------------------------------------------------

// Two weight loaders staged as one B tile: L0's rows first, L1's rows at L0::TILE (gate then up
// for GateUpMMA, which reads up at row BN). Threads [0, HALF) stage L0's tile, [HALF, 2 HALF)
// L1's (each loader is built for HALF threads: a 16-row float tile has chunks for 64 threads
// only). Same load/store interface as the loaders of gemm.h, so gemm_k_loop runs unchanged.
template <typename T, typename L0, typename L1, short HALF>
struct StackedLoader {
  static constant constexpr int TILE = L0::TILE + L1::TILE;
  static constant constexpr short VW = 16 / sizeof(T);
  L0 first;
  L1 second;
  bool in_first;  // this thread stages L0's tile (else L1's)

  StackedLoader(ushort tid, int K)
      : first(ushort(tid % HALF), K), second(ushort(tid % HALF), K), in_first(tid < HALF) {}

  void load(int k0, bool check_k) {
    if (in_first) {
      first.load(k0, check_k);
    } else {
      second.load(k0, check_k);
    }
  }

  template <typename Op>
  void store(threadgroup T* dst, thread const Op& op) {
    if (in_first) {
      first.store(dst, op);
    } else {
      second.store(dst + L0::TILE, op);
    }
  }

  void store(threadgroup T* dst) { store(dst, NoTransform()); }
};

// The gate/up weight loader of 2 * BN rows: weights of one format (same operand type) share one
// loader as in the fused SwiGLU (bind_gate_up_rows); otherwise each has its own loader of BN
// rows for half the threads, in a StackedLoader.
template <bool SAME, typename T, short BN, short BK, short LD, short NT, typename WG, typename WU>
struct GateUpLoaderOf {
  typedef typename WG::template Loader<T, 2 * BN, BK, LD, NT> type;
  static void bind(thread type& lb, WG g, WU u, int n0, int N, int K, bool vec) {
    bind_gate_up_rows<BN>(lb, g, u, n0, N, K, vec);
  }
};
template <typename T, short BN, short BK, short LD, short NT, typename WG, typename WU>
struct GateUpLoaderOf<false, T, BN, BK, LD, NT, WG, WU> {
  typedef StackedLoader<T, typename WG::template Loader<T, BN, BK, LD, NT / 2>,
                        typename WU::template Loader<T, BN, BK, LD, NT / 2>, NT / 2>
      type;
  static void bind(thread type& lb, WG g, WU u, int n0, int N, int K, bool vec) {
    bind_weight_rows(lb.first, g, n0, N, K, vec);
    bind_weight_rows(lb.second, u, n0, N, K, vec);
  }
};

// The x loader's chunks read the tokens of sorted rows m0 + tile_row (rows at or past row_end
// clamp to row_end - 1: computed, never stored): token = order[row] / top_k of x (tokens, K),
// row-contiguous. vec: the kernel's VEC (K is a multiple of the vector width).
template <typename Loader, typename XPtr, typename OPtr>
void bind_gathered_rows(thread Loader& la, XPtr x, OPtr order, int top_k, int K, int m0,
                        int row_end, bool vec) {
  la.vec = vec;
  la.k_stride = 1;
  BRICKS_UNROLL
  for (short i = 0; i < Loader::NCH; ++i) {
    const int row = min(m0 + int(la.tile_row(i)), row_end - 1);
    la.src[i] = x + long(int(order[row]) / top_k) * K;
  }
}

// The down projection's epilogue: lane element (r, c) of the block, sorted row m0 + r < m0 +
// rows, column n0 + c < D, goes to output row order[m0 + r] (the un-sort to (token, slot)
// order), plus the expert's bias row in float, one rounding.
template <bool HAS_BIAS, typename MMA, typename T, typename OPtr, typename BPtr>
void scatter_store(thread MMA& mma, device T* y, OPtr order, BPtr bias, int m0, int rows, int n0,
                   int D) {
  BRICKS_UNROLL
  for (short i = 0; i < MMA::TM; ++i) {
    const short r = mma.row0 + i * 8;
    if (r >= rows) continue;
    device T* yrow = y + long(order[m0 + r]) * D;
    BRICKS_UNROLL
    for (short j = 0; j < MMA::TN; ++j) {
      const int c = n0 + mma.col0 + j * 8;
      thread auto& e = mma.acc[i][j].thread_elements();
      BRICKS_UNROLL
      for (short q = 0; q < 2; ++q) {
        if (c + q < D) yrow[c + q] = T(float(e[q]) + (HAS_BIAS ? float(bias[c + q]) : 0.0f));
      }
    }
  }
}

// Sorted rows [m0, m0 + rows), columns [n0, n0 + BN) of an (R, N) output are quiet NaN (the
// rows of out-of-range indices; only reached with the op's index check off): output row
// order[row] when SCATTER (the down projection's un-sort), else row itself.
template <bool SCATTER, short BN, short NT, typename T, typename OPtr>
void fill_nan_rows(device T* out, OPtr order, int m0, int rows, int n0, int N, ushort tid) {
  const int cols = min(int(BN), N - n0);
  for (int i = int(tid); i < rows * cols; i += NT) {
    const int row = m0 + i / cols;
    const long dst = SCATTER ? long(order[row]) : long(row);
    out[dst * N + n0 + i % cols] = T(numeric_limits<float>::quiet_NaN());
  }
}

}  // namespace bricks

#endif  // MLX_BRICKS_MOE_H
