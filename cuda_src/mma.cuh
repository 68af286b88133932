// mma.cuh -- the tensor-core and copy primitives every CUDA twin is built on (sm_80+).
//
//   cp_async16 / cp_async_commit / cp_async_wait<N>   16-byte global -> shared copies that
//                                                     bypass registers (Ampere cp.async.cg),
//                                                     zero-filled when predicated off.
//   mbar_init / mbar_arrive / cp_async_mbar_arrive   mbarrier producer / consumer handshake
//   / mbar_wait / bar_sync / setmaxnreg_*            (warp-specialized kernels), named barrier,
//                                                     register budget per warpgroup (sm_90a).
//   ldmatrix_x4 / ldmatrix_x2 (+ _trans)              8x8 b16 fragments from shared memory.
//   mma_16816<T>                                      D = A * B + D, m16n8k16, f32 accumulate,
//                                                     T = __half or __nv_bfloat16.
//   pack2<T> / unpack2<T>                             two floats <-> one 32-bit register of T.
//   lop3_and_or                                       (a & b) | c in one LOP3.
//   h2_fma / h2_sub / h2_mul_rn / h2_add_rn<T>        HFMA2 / HSUB2 / HMUL2 / HADD2 on two T held
//                                                     as the bits of one 32-bit register, each
//                                                     rounded once to nearest even.
//   Num<T>                                            float conversion for __half, bf16, float
//                                                     (and int8_t -> float, for Q8_0 quants).
//   ldg16_as_float                                    16 aligned bytes of float/half/bf16/int8
//                                                     -> 4/8/8/16 floats (one 128-bit load).
//   i8x4_to_float4                                    four int8 in a 32-bit word -> float4,
//                                                     exact, without I2F (integer + FADD only).
//   ld_as_float<N>                                    N aligned elements -> floats, one load.
//   warp_max / warp_sum                               butterfly over all 32 lanes of a warp.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with lane = 4 * g + t,
//   A (16x16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, col):  b0 = (k=2t..2t+1, n=g), b1 = (k=2t+8.., n=g)
//   C (16x8):       c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// ldmatrix_x4 on a row-major 16x16 tile whose row r, column block c (8 wide) is addressed by lane
// (r = lane % 16, c = lane / 16) returns exactly a0..a3; on an (n, k) tile (rows n, k contiguous)
// addressed by lane (n = (lane / 16) * 8 + lane % 8, k block = (lane / 8) % 2) it returns the B
// fragments of two n8 blocks: {b0, b1} of n block 0 and {b0, b1} of n block 1.
//
// Source: PTX ISA 8.x (mma, ldmatrix, cp.async); the structure follows CUTLASS's SM80 atoms.
#ifndef MLX_BRICKS_MMA_CUH
#define MLX_BRICKS_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>

namespace bricks {

// ---------------------------------------------------------------------------------------------
// Numbers
// ---------------------------------------------------------------------------------------------

template <typename T>
struct Num;

template <>
struct Num<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
};

template <>
struct Num<__half> {
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Num<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};

template <>
struct Num<int8_t> {
  __device__ __forceinline__ static float to_float(int8_t v) { return static_cast<float>(v); }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return Num<T>::to_float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return Num<T>::from_float(v);
}

// Same<A, B>::value: whether two types are one (NVRTC has no <type_traits>), for if constexpr.
template <typename A, typename B>
struct Same {
  static constexpr bool value = false;
};
template <typename A>
struct Same<A, A> {
  static constexpr bool value = true;
};

// Two floats -> one 32-bit register holding two T (low half = lo), round to nearest even.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// One 32-bit register of two T -> (lo, hi) floats.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t r);

template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<__half2*>(&r));
}

template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}

// (a & b) | c in one LOP3: written as PTX because ptxas keeps two different immediates (a mask
// and an exponent magic) as two LOP3s; with both in registers one instruction does it.
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Paired 16-bit arithmetic on register bits (the layout of __half2 / __nv_bfloat162, low half
// first). Each result is the exact result rounded once to nearest even: fma.rn.{f16,bf16}x2 for
// h2_fma; h2_sub only ever computes exact differences here (magic-number removal); the _rn forms
// carry an explicit rounding so ptxas never contracts a multiply and an add into one fma.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

template <typename T>
__device__ __forceinline__ typename Pair<T>::type as_pair(uint32_t r) {
  return *reinterpret_cast<typename Pair<T>::type*>(&r);
}

template <typename V>
__device__ __forceinline__ uint32_t pair_bits(V v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c) {
  return pair_bits(__hfma2(as_pair<T>(a), as_pair<T>(b), as_pair<T>(c)));
}

template <typename T>
__device__ __forceinline__ uint32_t h2_sub(uint32_t a, uint32_t b) {
  return pair_bits(__hsub2(as_pair<T>(a), as_pair<T>(b)));
}

template <typename T>
__device__ __forceinline__ uint32_t h2_mul_rn(uint32_t a, uint32_t b) {
  return pair_bits(__hmul2_rn(as_pair<T>(a), as_pair<T>(b)));
}

template <typename T>
__device__ __forceinline__ uint32_t h2_add_rn(uint32_t a, uint32_t b) {
  return pair_bits(__hadd2_rn(as_pair<T>(a), as_pair<T>(b)));
}

// ---------------------------------------------------------------------------------------------
// Shared-memory addresses and asynchronous copies
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; when !pred the destination is zero-filled and src is not read
// (src must still be a valid address expression; callers clamp it).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred = true) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

// 4 bytes global -> shared (scales, biases, unaligned tails); zero-filled when !pred.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool pred = true) {
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Orders this thread's generic-proxy shared-memory writes (stores, cp.async) before later
// async-proxy reads (wgmma) once a barrier publishes them (sm_90; PTX "fence.proxy.async").
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// mbarriers (sm_80+): the producer / consumer handshake of warp-specialized kernels
// ---------------------------------------------------------------------------------------------

// A 64-bit mbarrier in shared memory expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

// One arrival (release: this thread's earlier shared-memory accesses happen before the phase
// completes for any waiter).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(
                   smem_addr(bar))
               : "memory");
}

// One arrival triggered when all of this thread's earlier cp.async copies have landed; the
// barrier's count must include it (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
}

// Wait until the phase of parity `parity` has completed (a fresh barrier's phase "-1", parity
// 1, counts as completed: producers start waiting on parity 1 of their empty barriers).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done = 0;
  while (!done) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(a), "r"(parity) : "memory");
#else
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(a), "r"(parity) : "memory");
#endif
  }
}

// Named barrier `id` (1..15) over `threads` threads (a multiple of 32): syncs a subset of the
// block, e.g. the consumer warps of a warp-specialized kernel while the producer has left.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Bytes of dynamic shared memory this launch was given (%dynamic_smem_size).
__device__ __forceinline__ uint32_t dynamic_smem_size() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
  return n;
}

// Per-thread register budget of this warpgroup from here on (sm_90a; all its threads execute
// it): producers give registers back (dec), consumers take them (inc). A template so that it
// is only instantiated (and assembled) for sm_90a kernels.
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// 16-bit pair registers the compiler must keep as they are until this point (the A operand of
// an asynchronous wgmma is read after the instruction issues).
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }

// ---------------------------------------------------------------------------------------------
// ldmatrix
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// ---------------------------------------------------------------------------------------------
// mma.sync m16n8k16, float accumulators
// ---------------------------------------------------------------------------------------------

template <typename T>
struct Mma16816;

template <>
struct Mma16816<__half> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct Mma16816<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  Mma16816<T>::run(d, a, b);
}

// ---------------------------------------------------------------------------------------------
// Warp reductions over the 4 lanes of one fragment row (lanes 4g .. 4g + 3)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---------------------------------------------------------------------------------------------
// 128-bit loads converted to float (memory-bound kernels: the decode attention brick)
// ---------------------------------------------------------------------------------------------

// Four int8 packed little-endian in w -> float4, exact. Each byte b is flipped to b + 128 (an
// unsigned 0..255), placed in the low mantissa bits of the float 2^23 (bit pattern 0x4B0000uu:
// the value 2^23 + u, exact) with one byte permute, and 2^23 + 128 is subtracted: integer and
// FADD pipes only, no I2F conversions (a quarter-rate instruction on sm_80/sm_90).
__device__ __forceinline__ float4 i8x4_to_float4(uint32_t w) {
  const uint32_t u = w ^ 0x80808080u;
  const float bias = 8388736.0f;  // 2^23 + 128
  float4 r;
  r.x = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - bias;
  r.y = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - bias;
  r.z = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - bias;
  r.w = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - bias;
  return r;
}

// 16 bytes at p, which must be 16-byte aligned, through the read-only path, as floats.
__device__ __forceinline__ void ldg16_as_float(const float* p, float (&o)[4]) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  o[0] = v.x;
  o[1] = v.y;
  o[2] = v.z;
  o[3] = v.w;
}

template <typename T>
__device__ __forceinline__ void ldg16_as_float_b16(const T* p, float (&o)[8]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void ldg16_as_float(const __half* p, float (&o)[8]) {
  ldg16_as_float_b16(p, o);
}

__device__ __forceinline__ void ldg16_as_float(const __nv_bfloat16* p, float (&o)[8]) {
  ldg16_as_float_b16(p, o);
}

__device__ __forceinline__ void ldg16_as_float(const int8_t* p, float (&o)[16]) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = i8x4_to_float4(w[i]);
    o[4 * i] = f.x;
    o[4 * i + 1] = f.y;
    o[4 * i + 2] = f.z;
    o[4 * i + 3] = f.w;
  }
}

// N consecutive elements at p as floats in one load of N * sizeof(E) bytes (<= 16): p must be
// aligned to N * sizeof(E) bytes.
template <int N, typename E>
__device__ __forceinline__ void ld_as_float(const E* p, float (&o)[N]) {
  static_assert(N * sizeof(E) <= 16, "at most 16 bytes per load");
  struct alignas(N * sizeof(E)) Chunk {
    E e[N];
  };
  const Chunk c = *reinterpret_cast<const Chunk*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i] = to_float(c.e[i]);
  }
}

// Four int8 quants: one 32-bit load and the exact conversion without I2F.
template <>
__device__ __forceinline__ void ld_as_float<4, int8_t>(const int8_t* p, float (&o)[4]) {
  const float4 f = i8x4_to_float4(*reinterpret_cast<const uint32_t*>(p));
  o[0] = f.x;
  o[1] = f.y;
  o[2] = f.z;
  o[3] = f.w;
}

// ---------------------------------------------------------------------------------------------
// Whole-warp reductions (every lane gets the result)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, m);
  }
  return v;
}

}  // namespace bricks

#endif  // MLX_BRICKS_MMA_CUH
