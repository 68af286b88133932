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
//   fill<COUNT, NT>(tid, f)          f(e) for this thread's e of 0 .. COUNT - 1 (tid, tid + NT,
//                                    ...), unrolled: the loads of a slice fill issue together
//   aligned16(p)                     whether p may be read 16 bytes at a time
//   ld8(base, off, inside, vec)      base[off .. off + 7] (bf16s) as one 16-byte word: one load
//                                    where vec (base + off 16-byte aligned), else eight; zeros
//                                    where !inside (base + off not formed)
//   ld4f(base, off, inside, vec)     the same for four floats
//   st8(s, v)                        16 bytes into shared memory (s 16-byte aligned)
//   split8(v, w, hi, lo)             w * each of v's bf16s, split: 8 hi and 8 lo bf16s stored
//   split4(v, hi, lo)                four floats split: 4 hi and 4 lo bf16s stored (8 bytes)
//   st2(p, a, b)                     two outputs p[0], p[1] in one store (p 2-element aligned:
//                                    an even offset into a kernel's own output)
//   V8<X>, V4<X>                     X / 8, X / 4 rounded up to 1 (the tensor-core branch is
//                                    compiled, not run, for shapes whose rows are not 8 wide)
// The vector forms move the same values as the element-wise ones (splits round as split_bf16):
// fewer load / store instructions and less index arithmetic per element.
#ifndef MLX_BRICKS_SSD_MMA_CUH
#define MLX_BRICKS_SSD_MMA_CUH

namespace bricks {

__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
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

template <int X>
constexpr int V8 = X / 8 > 0 ? X / 8 : 1;
template <int X>
constexpr int V4 = X / 4 > 0 ? X / 4 : 1;

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// (any T, so that the scalar instantiations compile the tensor-core branch; it runs for bf16)
template <typename T>
__device__ __forceinline__ uint4 ld8(const T* base, int64_t off, bool inside, bool vec) {
  if (!inside) return make_uint4(0u, 0u, 0u, 0u);
  if (vec) return *reinterpret_cast<const uint4*>(base + off);
  const unsigned short* q = reinterpret_cast<const unsigned short*>(base + off);
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) w[e] = uint32_t(q[2 * e]) | (uint32_t(q[2 * e + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float4 ld4f(const float* base, int64_t off, bool inside, bool vec) {
  if (!inside) return make_float4(0.f, 0.f, 0.f, 0.f);
  if (vec) return *reinterpret_cast<const float4*>(base + off);
  const float* q = base + off;
  return make_float4(q[0], q[1], q[2], q[3]);
}

__device__ __forceinline__ void st8(__nv_bfloat16* s, uint4 v) {
  *reinterpret_cast<uint4*>(s) = v;
}

// (hi, lo) of a and b as two packed pairs, rounded as split_bf16
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
  hi = pack2<__nv_bfloat16>(a, b);
  const float2 h = unpack2<__nv_bfloat16>(hi);
  lo = pack2<__nv_bfloat16>(a - h.x, b - h.y);
}

__device__ __forceinline__ void split8(uint4 v, float w, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  const uint32_t in[4] = {v.x, v.y, v.z, v.w};
  uint32_t h[4], l[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = unpack2<__nv_bfloat16>(in[e]);
    split_pair(w * f.x, w * f.y, h[e], l[e]);
  }
  *reinterpret_cast<uint4*>(hi) = make_uint4(h[0], h[1], h[2], h[3]);
  *reinterpret_cast<uint4*>(lo) = make_uint4(l[0], l[1], l[2], l[3]);
}

__device__ __forceinline__ void split4(float4 v, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  uint32_t h0, h1, l0, l1;
  split_pair(v.x, v.y, h0, l0);
  split_pair(v.z, v.w, h1, l1);
  *reinterpret_cast<uint2*>(hi) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(lo) = make_uint2(l0, l1);
}

template <typename T>
__device__ __forceinline__ void st2(T* p, float a, float b) {
  if constexpr (Same<T, float>::value) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  } else {
    *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
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
