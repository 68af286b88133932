// qgemm_ops.cuh -- the epilogue ops of qgemm.cuh's kernels: each turns the float accumulators
// of 8 adjacent output columns (col .. col + nv - 1 in bounds) of one output row into the
// values stored (one rounding). Needs mma.cuh and gemm.cuh (activation<ACT>) before it.
//
//   QBiasResidual   acc (+ bias[col]) (+ residual[row, col])          the linear
//   QGateUp         act(gate + b_gate) * (up + b_up), operands 0 / 1   the fused SwiGLU
//   (qmoe.cuh adds the MoE ops.)
#ifndef MLX_BRICKS_QGEMM_OPS_CUH
#define MLX_BRICKS_QGEMM_OPS_CUH

namespace bricks {

// p[0 .. nv) as floats (0 past nv): one 16-byte load when all 8 are in bounds and aligned.
template <typename T>
__device__ __forceinline__ void load8(const T* p, int nv, float (&o)[8]) {
  if (nv == 8 && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    ldg16_as_float_b16(p, o);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = e < nv ? to_float(p[e]) : 0.0f;
}

// The gate and up biases of 8 columns (0 where absent).
template <bool HAS_BIAS_GATE, bool HAS_BIAS_UP, typename T>
__device__ __forceinline__ void gate_up_biases(const T* b_gate, const T* b_up, int col, int nv,
                                               float (&bg)[8], float (&bu)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) bg[e] = bu[e] = 0.0f;
  if constexpr (HAS_BIAS_GATE) load8(b_gate + col, nv, bg);
  if constexpr (HAS_BIAS_UP) load8(b_up + col, nv, bu);
}

// acc (+ bias[col]) (+ residual[row, col]) in float, one rounding on the store.
template <typename T, bool HAS_BIAS, bool HAS_RESIDUAL>
struct QBiasResidual {
  const T* bias;
  const T* residual;
  long ld;

  __device__ __forceinline__ void operator()(const float (&v)[1][8], long row, int col, int nv,
                                             float (&o)[8]) const {
    float add[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = v[0][e];
    if constexpr (HAS_BIAS) {
      load8(bias + col, nv, add);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += add[e];
    }
    if constexpr (HAS_RESIDUAL) {
      load8(residual + row * ld + col, nv, add);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] += add[e];
    }
  }
};

// act(gate + b_gate) * (up + b_up) (operands 0 and 1), all in float, one rounding.
template <typename T, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, int ACT>
struct QGateUp {
  const T* b_gate;
  const T* b_up;

  __device__ __forceinline__ void operator()(const float (&v)[2][8], long, int col, int nv,
                                             float (&o)[8]) const {
    float bg[8], bu[8];
    gate_up_biases<HAS_BIAS_GATE, HAS_BIAS_UP>(b_gate, b_up, col, nv, bg, bu);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = activation<ACT>(v[0][e] + bg[e]) * (v[1][e] + bu[e]);
  }
};

}  // namespace bricks

#endif  // MLX_BRICKS_QGEMM_OPS_CUH
