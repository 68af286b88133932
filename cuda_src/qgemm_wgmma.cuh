// qgemm_wgmma.cuh -- the sm_90a consumer of qgemm.cuh: two warpgroups, wgmma with the
// dequantized weights as the register A operand (RS form) and the activation tile as the
// shared-memory B operand. Needs mma.cuh, gemm.cuh, wgmma.cuh and qgemm.cuh before it; not
// emulated on the CPU (warp_emu.h skips it; the pipeline, QFrag and the epilogue it shares with
// QMmaConsumer are).
//
//   WgmmaRs<N, T>::run   wgmma.mma_async m64nNk16, f32 accumulate, A = 4 registers (the
//                        m16n8k16 A layout per warp: warp w of the warpgroup holds rows
//                        16 w .. 16 w + 15), B = a K-major 128-byte-swizzle descriptor.
//   QWgmmaConsumer       warpgroup c owns weight rows [64 MB c, 64 MB (c + 1)) (MB m64 blocks)
//                        and all BM tokens. Each k16 step is one commit group; DEPTH groups stay
//                        in flight. The A operand is read asynchronously, so the fragments of
//                        the last R = 4 (DEPTH >= 2) or 2 steps live in a register ring and a
//                        slot is overwritten only after the wait that retires its group (the
//                        fence_reg before the write keeps ptxas from reusing the registers
//                        earlier). The stage before is released once its last group retired.
// Source: PTX ISA 8.x (wgmma.mma_async register A operand, wgmma.fence / wait_group).
#ifndef MLX_BRICKS_QGEMM_WGMMA_CUH
#define MLX_BRICKS_QGEMM_WGMMA_CUH

namespace bricks {

template <int N, typename T>
struct WgmmaRs;

#define BRICKS_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define BRICKS_F16(i) BRICKS_F4(i), BRICKS_F4(i + 4), BRICKS_F4(i + 8), BRICKS_F4(i + 12)
#define BRICKS_F32(i) BRICKS_F16(i), BRICKS_F16(i + 16)
#define BRICKS_F64(i) BRICKS_F32(i), BRICKS_F32(i + 32)
#define BRICKS_F128(i) BRICKS_F64(i), BRICKS_F64(i + 64)
#define BRICKS_RS_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define BRICKS_RS_REGS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define BRICKS_RS_REGS_256 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// N accumulator registers 0 .. N / 2 - 1, then a0..a3 (A0..A3), the B descriptor (DB), the
// scale-d flag (SD): operand numbers as strings.
#define BRICKS_WGMMA_RS(N, TY, CT, ACC, A0, A1, A2, A3, DB, SD)                                \
  template <>                                                                                  \
  struct WgmmaRs<N, CT> {                                                                      \
    __device__ __forceinline__ static void run(float (&d)[N / 2], const uint32_t (&a)[4],      \
                                               uint64_t db) {                                  \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SD ", 0;\n"                            \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "             \
                   BRICKS_RS_REGS_##N ", {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" DB           \
                   ", p, 1, 1, 0;\n}\n"                                                        \
                   : ACC                                                                       \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));             \
    }                                                                                          \
  };
BRICKS_WGMMA_RS(64, "bf16", __nv_bfloat16, BRICKS_F32(0), "32", "33", "34", "35", "36", "37")
BRICKS_WGMMA_RS(64, "f16", __half, BRICKS_F32(0), "32", "33", "34", "35", "36", "37")
BRICKS_WGMMA_RS(128, "bf16", __nv_bfloat16, BRICKS_F64(0), "64", "65", "66", "67", "68", "69")
BRICKS_WGMMA_RS(128, "f16", __half, BRICKS_F64(0), "64", "65", "66", "67", "68", "69")
BRICKS_WGMMA_RS(256, "bf16", __nv_bfloat16, BRICKS_F128(0), "128", "129", "130", "131", "132",
                "133")
BRICKS_WGMMA_RS(256, "f16", __half, BRICKS_F128(0), "128", "129", "130", "131", "132", "133")
#undef BRICKS_WGMMA_RS

template <class C, int MB, int DEPTH>
struct QWgmmaConsumer {
  using T = typename C::T;
  static constexpr bool ASYNC = true;
  static constexpr int MI = MB;
  static constexpr int NJ = C::BM / 8;
  static constexpr int R = DEPTH >= 2 ? 4 : 2;           // A-fragment ring (k16 steps)
  static constexpr int RELEASE = DEPTH > 0 ? DEPTH - 1 : 0;  // step that frees the last stage
  static_assert(C::BN == 2 * 64 * MB, "two consumer warpgroups of MB m64 blocks");
  static_assert(C::OUT_N % (64 * MB) == 0, "a warpgroup's rows belong to one operand");
  static_assert(C::BM == 64 || C::BM == 128 || C::BM == 256, "wgmma N: 64, 128 or 256 tokens");
  static_assert(DEPTH >= 0 && DEPTH <= R - 1, "the ring must outlive the groups in flight");
  float acc[MI][NJ][4];
  uint32_t a[R][MI][4];
  int wg, wq;

  __device__ QWgmmaConsumer(int warp, int) : wg(warp / 4), wq(warp % 4) {
    zero_regs(acc);
    zero_regs(a);
  }

  __device__ __forceinline__ int row16(int i) const { return wg * 64 * MB + 64 * i + 16 * wq; }
  __device__ __forceinline__ int tok0() const { return 0; }

  __device__ __forceinline__ float (&flat(int i))[NJ * 4] {
    return reinterpret_cast<float(&)[NJ * 4]>(acc[i][0][0]);
  }

  __device__ __forceinline__ void fence_acc() {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) fence_operand(acc[i][j][e]);
  }

  __device__ __forceinline__ void stage(const unsigned char* xs, const unsigned char* ws,
                                        const uint32_t (&sb)[MI][2][C::GPS], const QFrag<C>& fr,
                                        uint64_t* prev, uint64_t*) {
    const uint32_t xa = smem_addr(xs);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      constexpr int QS = C::GPS == 2 ? 2 : 4;
      uint32_t(&ak)[MI][4] = a[kb % R];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) fence_reg(ak[i][e]);  // its group has retired
        fr(ws, row16(i), kb, sb[i][0][kb / QS], sb[i][1][kb / QS], ak[i]);
      }
      fence_acc();
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < MI; ++i) WgmmaRs<C::BM, T>::run(flat(i), ak[i], wgmma_desc(xa + kb * 32));
      wgmma_commit();
      wgmma_wait<DEPTH>();
      fence_acc();
      if (kb == RELEASE && prev != nullptr) mbar_arrive(prev);
    }
  }

  __device__ __forceinline__ void drain() {
    wgmma_wait<0>();
    fence_acc();
  }
};

template <class C, int MI, int WR, int DEPTH>
struct QConsumerOf<C, true, MI, WR, DEPTH> {
  using type = QWgmmaConsumer<C, MI, DEPTH>;
};

}  // namespace bricks

#endif  // MLX_BRICKS_QGEMM_WGMMA_CUH
