// tile4.h -- 4x4 register tiles of float FMAs (the SSD brick's products; CUDA twin:
// cuda_src/tile4.cuh, the same names).
//   ld4(p)                  four consecutive floats of threadgroup memory as a float4
//   fma_outer4(acc, a, b)   acc[u][v] += a[u] * b[v], 16 FMAs
//   tri_row(j)              row r of the j-th tile of a lower triangle listed by rows
//                           (j = r (r + 1) / 2 + column)

#ifndef MLX_BRICKS_TILE4_H
#define MLX_BRICKS_TILE4_H

#include <metal_stdlib>

using namespace metal;

namespace bricks {

inline float4 ld4(threadgroup const float* p) {
  return float4(p[0], p[1], p[2], p[3]);
}

inline void fma_outer4(thread float (&acc)[4][4], float4 a, float4 b) {
  #pragma clang loop unroll(full)
  for (int u = 0; u < 4; ++u) {
    #pragma clang loop unroll(full)
    for (int v = 0; v < 4; ++v) {
      acc[u][v] = fma(a[u], b[v], acc[u][v]);
    }
  }
}

inline int tri_row(int j) {
  int r = int((sqrt(8.0f * float(j) + 1.0f) - 1.0f) * 0.5f);
  r += (r + 1) * (r + 2) / 2 <= j ? 1 : 0;  // the float root's rounding, either way
  return r - (r * (r + 1) / 2 > j ? 1 : 0);
}

}  // namespace bricks

#endif  // MLX_BRICKS_TILE4_H
