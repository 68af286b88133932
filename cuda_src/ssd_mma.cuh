// ssd_mma.cuh -- the SSD twin's tensor-core products for bfloat16 inputs: mma.sync m16n8k16
// (bf16 x bf16, float accumulators) on fragments loaded by ldmatrix from bf16 arrays in shared
// memory (mma.cuh: the instructions and the fragment layouts). A float operand is split as
// hi + lo, two bf16s (hi = bf16(v), lo = bf16(v - hi): about 16 significant bits, relative
// error <= 2^-17), and multiplied twice; the bf16 inputs (x, B, C) are exact. Arrays have row
// strides (ld, in elements) of a multiple of 16 plus 8: 16-byte rows, no bank conflicts.
//   split_bf16(v, hi, lo)            the split
//   frag_a(a, s, ld, r0, k0)         A (16 x 16) from s[r][k]: rows r0.., columns k0..
//   frag_a_t(a, s, ld, r0, k0)       A (16 x 16) from s[k][r] (stored transposed)
//   frag_b2(b, s, ld, n0, k0)        B of two n8 tiles (k0.., n0.. and n0 + 8..) from s[n][k]:
//                                    tile 0 in b[0], b[1], tile 1 in b[2], b[3]
//   frag_b2_t(b, s, ld, k0, n0)      the same from s[k][n]
//   mma2(d, a, b)                    d[j] += A B_j for the two tiles of b
//   as_bf16(v)                       an input element as bf16 (exact for bf16: the MMA path's;
//                                    any type, so that the scalar instantiations compile it)
//   fill<COUNT, NT>(tid, f)          f(e) for this thread's e of 0 .. COUNT - 1 (tid, tid + NT,
//                                    ...), unrolled: the loads of a slice fill issue together
#ifndef MLX_BRICKS_SSD_MMA_CUH
#define MLX_BRICKS_SSD_MMA_CUH

namespace bricks {

__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
}

__device__ __forceinline__ __nv_bfloat16 as_bf16(__nv_bfloat16 v) { return v; }

template <typename T>
__device__ __forceinline__ __nv_bfloat16 as_bf16(T v) {
  return __float2bfloat16_rn(to_float(v));
}

template <int COUNT, int NT, typename F>
__device__ __forceinline__ void fill(int tid, F&& f) {
#pragma unroll  // loads issued together
  for (int r = 0; r < (COUNT + NT - 1) / NT; ++r) {
    const int e = tid + r * NT;
    if (COUNT % NT == 0 || e < COUNT) {
      f(e);
    }
  }
}

// ldmatrix: lane l gives the address of row l % 8 of 8x8 matrix l / 8; the four matrices in
// the order of the fragment's registers (mma.cuh's layouts).
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0,
                                       int k0) {
  const int l = int(threadIdx.x) % 32;
  ldmatrix_x4(a, smem_addr(s + (r0 + l % 8 + ((l / 8) % 2) * 8) * ld + k0 + (l / 16) * 8));
}

__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], const __nv_bfloat16* s, int ld,
                                         int r0, int k0) {
  const int l = int(threadIdx.x) % 32;
  ldmatrix_x4_trans(a, smem_addr(s + (k0 + l % 8 + (l / 16) * 8) * ld + r0 + ((l / 8) % 2) * 8));
}

__device__ __forceinline__ void frag_b2(uint32_t (&b)[4], const __nv_bfloat16* s, int ld, int n0,
                                        int k0) {
  const int l = int(threadIdx.x) % 32;
  ldmatrix_x4(b, smem_addr(s + (n0 + l % 8 + (l / 16) * 8) * ld + k0 + ((l / 8) % 2) * 8));
}

__device__ __forceinline__ void frag_b2_t(uint32_t (&b)[4], const __nv_bfloat16* s, int ld,
                                          int k0, int n0) {
  const int l = int(threadIdx.x) % 32;
  ldmatrix_x4_trans(b, smem_addr(s + (k0 + l % 8 + ((l / 8) % 2) * 8) * ld + n0 + (l / 16) * 8));
}

__device__ __forceinline__ void mma2(float (&d)[2][4], const uint32_t (&a)[4],
                                     const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]};
  const uint32_t b1[2] = {b[2], b[3]};
  mma_16816<__nv_bfloat16>(d[0], a, b0);
  mma_16816<__nv_bfloat16>(d[1], a, b1);
}

}  // namespace bricks

#endif  // MLX_BRICKS_SSD_MMA_CUH
