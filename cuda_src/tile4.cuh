// tile4.cuh -- 4x4 register tiles of float FMAs (the SSD brick's products; the MSL kernels use
// the same names from metal_src/tile4.h). Plain C++ over float4: the CUDA emulator in tests
// compiles it as it is.
//   ld4(p)                  four consecutive floats of shared memory (16-byte aligned), one load
//   fma_outer4(acc, a, b)   acc[u][v] += a[u] * b[v], 16 FMAs
//   tri_row(j)              row r of the j-th tile of a lower triangle listed by rows
//                           (j = r (r + 1) / 2 + column)
#ifndef MLX_BRICKS_TILE4_CUH
#define MLX_BRICKS_TILE4_CUH

namespace bricks {

__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}

__device__ __forceinline__ void fma_outer4(float (&acc)[4][4], const float4 a, const float4 b) {
  const float av[4] = {a.x, a.y, a.z, a.w};
  const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int u = 0; u < 4; ++u) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      acc[u][v] = fmaf(av[u], bv[v], acc[u][v]);
    }
  }
}

__device__ __forceinline__ int tri_row(int j) {
  int r = int((sqrtf(8.0f * float(j) + 1.0f) - 1.0f) * 0.5f);
  r += (r + 1) * (r + 2) / 2 <= j ? 1 : 0;  // the float root's rounding, either way
  return r - (r * (r + 1) / 2 > j ? 1 : 0);
}

}  // namespace bricks

#endif  // MLX_BRICKS_TILE4_CUH
