// swiglu.h -- Brick 3 (SwiGLU MLP) as a thin layer on gemm.h: loader binding, the gate + up
// MMA block of the fused kernel, and the act(gate) * up epilogue math. Concatenated after
// gemm.h by the kernel registry (headers = gemm.h, swiglu.h).
//
// The gate's activation is the kernels' ACT template parameter (one kernel, not a copy per
// activation): ACT_SILU (0, SwiGLU: llama, qwen) or ACT_GELU_TANH (1, GeGLU with the tanh
// approximation of GELU: gemma's gelu_approx).
//
//   silu, gelu_tanh                the activations in float, with no inf or NaN intermediate.
//   swiglu_value<ACT>              act(g) * u in float.
//   bind_x_rows                    points a TileLoader at rows of x read through x's strides.
//   bind_gate_up_rows              one weight loader of 2 * BN rows: w_gate rows, then w_up
//                                  rows (float or affine-quantized, one format for both).
//   GateUpMMA                      two SimdgroupMMA blocks of one geometry; each A fragment
//                                  read from threadgroup memory feeds both gate and up.
//   swiglu_combine                 gate acc <- act(gate + b_gate) * (up + b_up), in registers.
//   SwiGLUUpEpilogue               split variant: store op that reads the up projection.

#ifndef MLX_BRICKS_SWIGLU_H
#define MLX_BRICKS_SWIGLU_H

#include <metal_stdlib>
#include <metal_simdgroup_matrix>

using namespace metal;

namespace bricks {

// SiLU(g) = g / (1 + exp(-g)). exp is taken of -|g| <= 0 so it can only underflow to 0, never
// overflow: no inf / inf or 0 * inf for any finite g, in any math mode. For g < 0 the same value
// is g * e / (1 + e) with e = exp(g). Large negative g gives -0, large positive g gives g.
inline float silu(float g) {
  const float e = precise::exp(-fabs(g));  // in [0, 1]
  const float d = 1.0f + e;                // in [1, 2]
  return g >= 0.0f ? g / d : (g * e) / d;
}

// GELU, tanh approximation (Hendrycks & Gimpel 2016; mlx.nn.gelu_approx):
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))). The tanh argument is clamped to
// [-10, 10] (tanh(10) rounds to 1 in float32), so g^3 overflowing to inf for huge |g| can
// never reach tanh: large positive g gives g, large negative g gives -0.
inline float gelu_tanh(float g) {
  const float u = 0.7978845608028654f * g * (1.0f + 0.044715f * g * g);
  return 0.5f * g * (1.0f + precise::tanh(clamp(u, -10.0f, 10.0f)));
}

// The kernels' ACT template parameter.
enum Activation : int { ACT_SILU = 0, ACT_GELU_TANH = 1 };

template <int ACT>
inline float activation(float g) {
  static_assert(ACT == ACT_SILU || ACT == ACT_GELU_TANH, "ACT must be 0 (SiLU) or 1 (GELU-tanh)");
  return ACT == ACT_GELU_TANH ? gelu_tanh(g) : silu(g);
}

// act(g) * u for the ACT activation.
template <int ACT>
inline float swiglu_value(float g, float u) {
  return activation<ACT>(g) * u;
}

// Points the loader's chunks at rows m0 + tile_row of x, the flattened leading dims of a
// strided (..., K) array (rows past M clamp to M - 1: computed, never stored), and allows the
// 128-bit path only when K is contiguous and every row start stays 16-byte aligned.
// vec_k: the kernel's VEC (K is a multiple of the vector width). Ptr: x's pointer type
// (MLX passes inputs of fewer than 8 elements in the constant address space).
template <typename Loader, typename Ptr>
void bind_x_rows(thread Loader& la, Ptr x, const constant int* shape,
                 const constant int64_t* strides, int n_lead, int M, int m0, bool vec_k) {
  bool vec = vec_k && strides[n_lead] == 1;
  for (int d = 0; d < n_lead; ++d) {
    if (shape[d] > 1 && strides[d] % Loader::VW != 0) vec = false;
  }
  la.vec = vec;
  la.k_stride = strides[n_lead];
  BRICKS_UNROLL
  for (short i = 0; i < Loader::NCH; ++i) {
    const int m = min(m0 + int(la.tile_row(i)), M - 1);
    la.src[i] = x + strided_row_offset(m, shape, strides, n_lead);
  }
}

// One loader for both weights: tile rows [0, BN) are w_gate rows n0.., rows [BN, 2 BN) are
// w_up rows n0.. (rows past N clamp to N - 1, never stored). Both weights are operands of one
// format (DenseWeight, or AffineWeight of the same bits and group size), hence one loader type.
template <short BN, typename Loader, typename W>
void bind_gate_up_rows(thread Loader& lb, W w_gate, W w_up, int n0, int N, int K, bool vec_k) {
  lb.vec = vec_k;
  BRICKS_UNROLL
  for (short i = 0; i < Loader::NCH; ++i) {
    const short r = lb.tile_row(i);
    const bool is_up = r >= BN;
    const int n = min(n0 + int(is_up ? r - BN : r), N - 1);
    lb.bind(i, is_up ? w_up : w_gate, n, K);
  }
}

// The fused block: gate and up each a BM x BN SimdgroupMMA of the same WM x WN simdgroup
// layout, so every simdgroup holds gate and up for the same output elements in the same lanes
// (the epilogue needs no exchange through threadgroup memory). Bs holds 2 * BN weight rows
// with pitch LDB: gate rows first, then up rows.
template <short BM, short BN, short BK, short WM, short WN, short LDA, short LDB,
          bool SCHED = false>
struct GateUpMMA {
  using Block = SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB, SCHED>;
  Block gate;
  Block up;  // its a_frag is never used: gate.a_frag feeds both products

  GateUpMMA(ushort sg, ushort lane) : gate(sg, lane), up(sg, lane) {}

  // gate.acc += As * Bs[0:BN]^T and up.acc += As * Bs[BN:2 BN]^T for one buffer pair.
  template <typename T>
  void mma(const threadgroup T* As, const threadgroup T* Bs) {
    const threadgroup T* Bu = Bs + BN * LDB;
    BRICKS_UNROLL
    for (short kk = 0; kk < BK; kk += 8) {
      Block::hint();
      gate.load_a(As, kk);
      Block::hint();
      gate.load_b(Bs, kk);
      up.load_b(Bu, kk);
      Block::hint();
      BRICKS_UNROLL
      for (short i = 0; i < Block::TM; ++i) {
        BRICKS_UNROLL
        for (short j = 0; j < Block::TN; ++j) {
          simdgroup_multiply_accumulate(gate.acc[i][j], gate.a_frag[i], gate.b_frag[j],
                                        gate.acc[i][j]);
          simdgroup_multiply_accumulate(up.acc[i][j], gate.a_frag[i], up.b_frag[j],
                                        up.acc[i][j]);
        }
      }
    }
  }
};

// mma.gate.acc <- act(gate + b_gate) * (up + b_up) (act: ACT), elementwise in float
// registers, so the block is then written once by mma.gate.store / store_checked. Bias
// pointers are the whole (N,) vectors (placeholders when absent: never read); columns past N
// clamp to N - 1 so edge tiles read in bounds (those values are never stored).
template <int ACT, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, typename MMA, typename GPtr,
          typename UPtr>
void swiglu_combine(thread MMA& mma, GPtr b_gate, UPtr b_up, int n0, int N) {
  BRICKS_UNROLL
  for (short i = 0; i < MMA::Block::TM; ++i) {
    BRICKS_UNROLL
    for (short j = 0; j < MMA::Block::TN; ++j) {
      const int c = n0 + mma.gate.col0 + j * 8;
      thread auto& g = mma.gate.acc[i][j].thread_elements();
      const thread auto& u = mma.up.acc[i][j].thread_elements();
      BRICKS_UNROLL
      for (short e = 0; e < 2; ++e) {
        const int n = min(c + e, N - 1);
        float gv = g[e];
        float uv = u[e];
        if (HAS_BIAS_GATE) gv += float(b_gate[n]);
        if (HAS_BIAS_UP) uv += float(b_up[n]);
        g[e] = swiglu_value<ACT>(gv, uv);
      }
    }
  }
}

// Store op that writes the value as computed (the SwiGLU already applied in registers).
struct StoreAsIs {
  float operator()(float v, short, short) const { return v; }
};

// Split variant's store op: act(acc + bias[col]) * up[row, col] (act: ACT). Only called for stored
// (in-bounds) elements, so reading up at (row, col) is safe. Pointer types as the inputs'.
template <int ACT, bool HAS_BIAS, typename BiasPtr, typename UpPtr>
struct SwiGLUUpEpilogue {
  BiasPtr bias;  // at the block's first column
  UpPtr up;      // at the block's (0, 0)
  int ldu;       // up row pitch

  float operator()(float v, short r, short c) const {
    if (HAS_BIAS) v += float(bias[c]);
    return swiglu_value<ACT>(v, float(up[long(r) * ldu + c]));
  }
};

}  // namespace bricks

#endif  // MLX_BRICKS_SWIGLU_H
