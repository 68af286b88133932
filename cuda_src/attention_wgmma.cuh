// attention_wgmma.cuh -- Hopper warpgroup MMA (wgmma, sm_90a) for the FlashAttention kernel
// family of attention_fa.cuh. Needs mma.cuh before it.
//
//   Sw128Desc::k_major / mn_major   shared-memory matrix descriptors of 128-byte-swizzled tiles
//   WgSS<N, T>::run(d, da, db, acc)  D (64 x N, f32) = A (smem) * B (smem)^T [+ D], both K-major
//   WgRS<N, T>::run(d, a, db)        D += A (registers) * B (smem), B MN-major (transposed)
//   wg_fence / wg_commit / wg_wait<N> / wg_reg_fence
//
// Layouts (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix ..."): a warpgroup is 4 warps; warp
// w of it holds rows 16 w .. 16 w + 15 of the 64 x N accumulator, d[4 j + e] = (row g + 8 (e / 2),
// column 8 j + 2 t + e % 2) with lane = 4 g + t: per warp the mma.sync m16n8 C layout, n8 block
// after n8 block. A in registers: per warp the mma.sync m16n8k16 A layout (a0 = (g, 2t..),
// a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)). So the softmax of
// attention.cuh runs unchanged on wgmma accumulators, and P (the S accumulator converted in
// registers) is the A operand of O += P V, as on the mma.sync path.
//
// Shared memory (attention_fa.cuh's tiles): 64-column panels of 128-byte rows, the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8), panels 1024-byte aligned (the hardware XORs
// address bits 4-6 with bits 7-9; base offset 0). K-major operand (Q as A, K as B of S = Q K^T:
// rows are M/N, head_dim is K): 8-row groups 1024 bytes apart (SBO), a k16 step is 32 bytes
// further along the row, a 64-column panel further is the next panel. MN-major operand (V as
// B of O = P V, transposed: keys are K, head_dim is N): canonical layout
// ((8, 8, m), (8, k)) : ((1, 8, LBO), (64, SBO)) in elements, so 64 head_dim columns of one key
// are one 128-byte row, LBO = the panel stride (next 64 columns), SBO = 1024 (next 8 keys), a
// k16 step is 16 rows = 2048 bytes further.
//
// Ordering: cp.async writes (generic proxy) are made visible to wgmma reads (async proxy) by
// fence.proxy.async in each writing thread after its cp.async wait, before the barrier that
// publishes them (mma.cuh fence_proxy_async). wgmma results are valid only after wg_wait; the
// accumulator registers are fenced (wg_reg_fence) so the compiler does not move their uses
// across it. The instructions exist only on sm_90a: elsewhere the wrappers compile to a trap
// and fa_forward refuses to build a wgmma variant (static_assert).
//
// tests/cuda_emu/wgmma_emu.h runs these wrappers on the CPU from the same PTX definitions.
#ifndef MLX_BRICKS_ATTENTION_WGMMA_CUH
#define MLX_BRICKS_ATTENTION_WGMMA_CUH

namespace bricks {
namespace attn {

// Matrix descriptors (PTX "Matrix Descriptor Format"): start address >> 4 (bits 0-13), leading
// byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset 0 (49-51), swizzle
// mode 1 = 128 bytes (62-63).
struct Sw128Desc {
  __host__ __device__ static constexpr uint64_t make(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
           (uint64_t((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t(1) << 62);
  }
  // K-major: LBO is not used by swizzled K-major layouts ("assumed 1": 16 bytes).
  __host__ __device__ static constexpr uint64_t k_major(uint32_t addr) {
    return make(addr, 16, 1024);
  }
  // MN-major: LBO = bytes between 64-column panels.
  __host__ __device__ static constexpr uint64_t mn_major(uint32_t addr, uint32_t panel_bytes) {
    return make(addr, panel_bytes, 1024);
  }
};

template <int N, typename T>
struct WgSS;
template <int N, typename T>
struct WgRS;

#ifndef BRICKS_HOST_EMULATION
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900  // plain sm_90: ptxas refuses wgmma
#define BRICKS_WG_ASM(...) asm volatile(__VA_ARGS__)
#else
#define BRICKS_WG_ASM(...) __trap()
#endif

__device__ __forceinline__ void wg_fence() { BRICKS_WG_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  BRICKS_WG_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  BRICKS_WG_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wg_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Register lists "%0, ..., %R-1" in chunks of 16 and the matching "+f" operand lists.
#define BRW0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define BRW1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define BRW2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define BRW3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define BRW4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define BRW5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define BRW6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
             "%110, %111"
#define BRW7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, " \
             "%125, %126, %127"
#define BRF4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define BRF16(i) BRF4(i), BRF4((i) + 4), BRF4((i) + 8), BRF4((i) + 12)
#define BRF32 BRF16(0), BRF16(16)
#define BRF48 BRF32, BRF16(32)
#define BRF64 BRF48, BRF16(48)
#define BRF96 BRF64, BRF16(64), BRF16(80)
#define BRF128 BRF96, BRF16(96), BRF16(112)
#define BR_STRIP(...) __VA_ARGS__

// One (N, type): both forms. REGS: the accumulator list; OPS: its operands, in parentheses;
// then the next operand numbers: SS (a-desc, b-desc, scale-d), RS ("{a0, a1, a2, a3}", b-desc).
#define BR_WGMMA(N, TY, PT, REGS, OPS, SSA, SSB, SSP, RSA, RSB)                                   \
  template <>                                                                                  \
  struct WgSS<N, TY> {                                                                         \
    __device__ __forceinline__ static void run(float (&d)[N / 2], uint64_t da, uint64_t db,    \
                                               uint32_t acc) {                                 \
      BRICKS_WG_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, " SSP ", 0;\n"                           \
                    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" PT " {" REGS "}, " SSA    \
                    ", " SSB ", p, 1, 1, 0, 0;\n}\n"                                           \
                    : BR_STRIP OPS                                                             \
                    : "l"(da), "l"(db), "r"(acc));                                             \
    }                                                                                          \
  };                                                                                           \
  template <>                                                                                  \
  struct WgRS<N, TY> {                                                                         \
    __device__ __forceinline__ static void run(float (&d)[N / 2], const uint32_t (&a)[4],      \
                                               uint64_t db) {                                  \
      BRICKS_WG_ASM("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" PT " {" REGS "}, " RSA    \
                    ", " RSB ", 1, 1, 1, 1;\n"                                                 \
                    : BR_STRIP OPS                                                             \
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));                    \
    }                                                                                          \
  };

#define BRW_64 BRW0 ", " BRW1
#define BRW_96 BRW_64 ", " BRW2
#define BRW_128 BRW_96 ", " BRW3
#define BRW_192 BRW_128 ", " BRW4 ", " BRW5
#define BRW_256 BRW_192 ", " BRW6 ", " BRW7
#define BR_WGMMA2(N, OPS, SSA, SSB, SSP, RSA, RSB)                                                \
  BR_WGMMA(N, __nv_bfloat16, ".bf16.bf16", BRW_##N, OPS, SSA, SSB, SSP, RSA, RSB)               \
  BR_WGMMA(N, __half, ".f16.f16", BRW_##N, OPS, SSA, SSB, SSP, RSA, RSB)

BR_WGMMA2(64, (BRF32), "%32", "%33", "%34", "{%32, %33, %34, %35}", "%36")
BR_WGMMA2(96, (BRF48), "%48", "%49", "%50", "{%48, %49, %50, %51}", "%52")
BR_WGMMA2(128, (BRF64), "%64", "%65", "%66", "{%64, %65, %66, %67}", "%68")
BR_WGMMA2(192, (BRF96), "%96", "%97", "%98", "{%96, %97, %98, %99}", "%100")
BR_WGMMA2(256, (BRF128), "%128", "%129", "%130", "{%128, %129, %130, %131}", "%132")
#endif  // BRICKS_HOST_EMULATION

}  // namespace attn
}  // namespace bricks

#endif  // MLX_BRICKS_ATTENTION_WGMMA_CUH
