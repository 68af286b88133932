// mma.cuh -- the tensor-core and copy primitives every CUDA twin is built on (sm_80+).
//
//   cp_async16 / cp_async_commit / cp_async_wait<N>   16-byte global -> shared copies that
//                                                     bypass registers (Ampere cp.async.cg),
//                                                     zero-filled when predicated off.
//   ldmatrix_x4 / ldmatrix_x2 (+ _trans)              8x8 b16 fragments from shared memory.
//   mma_16816<T>                                      D = A * B + D, m16n8k16, f32 accumulate,
//                                                     T = __half or __nv_bfloat16.
//   pack2<T> / unpack2<T>                             two floats <-> one 32-bit register of T.
//   Num<T>                                            float conversion for __half, bf16, float.
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

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return Num<T>::to_float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return Num<T>::from_float(v);
}

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

}  // namespace bricks

#endif  // MLX_BRICKS_MMA_CUH
