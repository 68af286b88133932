// attention_stage.cuh -- how the first CUDA attention kernel (attention.cuh) stages Q, K and V
// tiles in shared memory: 16-byte chunks by cp.async (element-wise bit copies for strided or
// misaligned views), and the Q8_0 codes dequantized into the K/V tiles. Needs mma.cuh and
// attention_common.cuh before it.
#ifndef MLX_BRICKS_ATTENTION_STAGE_CUH
#define MLX_BRICKS_ATTENTION_STAGE_CUH

namespace bricks {
namespace attn {

// An unsigned integer of N bytes (bit copies of elements on the element-wise load path).
template <int N>
struct BitsOf;
template <>
struct BitsOf<1> {
  using type = uint8_t;
};
template <>
struct BitsOf<2> {
  using type = uint16_t;
};
template <>
struct BitsOf<4> {
  using type = uint32_t;
};

// How NT threads split a ROWS x COLS tile into 16-byte chunks of CH elements: thread tid takes
// column chunk tid % CPR of rows tid / CPR + i * RPI (i = 0 .. ITERS - 1), so its shared and
// global addresses advance by a constant per step (no per-chunk address is kept live across the
// key loop). Threads tid >= RPI * CPR idle when CPR does not divide NT.
template <int ROWS, int COLS, int CH, int NT>
struct ChunkMap {
  static constexpr int CPR = COLS / CH;  // chunks per row
  static constexpr int RPI = NT / CPR;   // rows per step
  static constexpr int ITERS = (ROWS + RPI - 1) / RPI;
  static_assert(COLS % CH == 0 && RPI >= 1, "tile rows must be whole 16-byte chunks");
  __device__ __forceinline__ static bool has(int tid, int i) {
    return (NT % CPR == 0 || tid < RPI * CPR) && (ROWS % RPI == 0 || tid / CPR + i * RPI < ROWS);
  }
};

// Copy rows row0 .. row0 + ROWS - 1 (COLS elements each) of a strided global matrix into a
// shared tile with row stride LDS; rows >= nvalid, and rows < nlo (a padded batch row's
// padding keys: never read), become zeros. `fast` (uniform): unit column
// stride and 16-byte aligned rows, so 16-byte cp.async chunks; otherwise element-wise loads
// (bit copies: the values are not touched). Caller commits the cp.async group.
template <typename E, int ROWS, int COLS, int LDS, int NT>
__device__ __forceinline__ void copy_tile(E* dst, const E* src, int64_t row_stride,
                                          int64_t col_stride, int row0, int nvalid, bool fast,
                                          int tid, int nlo = 0) {
  constexpr int CH = 16 / int(sizeof(E));
  using M = ChunkMap<ROWS, COLS, CH, NT>;
  using Bits = typename BitsOf<sizeof(E)>::type;
  const int r = tid / M::CPR;
  const int col = (tid % M::CPR) * CH;
  E* d = dst + r * LDS + col;
  if (fast) {
    const E* s = src + int64_t(row0 + r) * row_stride + col;
    const int64_t step = int64_t(M::RPI) * row_stride;
#pragma unroll
    for (int i = 0; i < M::ITERS; ++i) {
      if (M::has(tid, i)) {
        const int row = row0 + r + i * M::RPI;
        const bool ok = row < nvalid && row >= nlo;
        cp_async16(smem_addr(d + i * M::RPI * LDS), ok ? s : src, ok);
      }
      s += step;
    }
  } else {
    // The slow path stays rolled: unrolled, its batched loads would compete for registers with
    // the O accumulator that is live around every tile load.
    const Bits* s = reinterpret_cast<const Bits*>(src);
#pragma unroll 1
    for (int i = 0; i < M::ITERS; ++i) {
      if (M::has(tid, i)) {
        const int row = row0 + r + i * M::RPI;
        const bool ok = row < nvalid && row >= nlo;
        Bits* db = reinterpret_cast<Bits*>(d + i * M::RPI * LDS);
#pragma unroll
        for (int e = 0; e < CH; ++e) {
          db[e] = ok ? s[int64_t(row) * row_stride + int64_t(col + e) * col_stride] : Bits(0);
        }
      }
    }
  }
}

// Q8_0 scales of the 16-code chunks this thread dequantizes (ChunkMap<BK, D, 16, NT>: the same
// chunks copy_tile stages for the codes), as float; 0 past nvalid and below nlo.
template <int BK, int D, int NT>
struct Q8Scales {
  using M = ChunkMap<BK, D, 16, NT>;
  float v[M::ITERS];

  __device__ __forceinline__ void load(const __half* s, int64_t row_stride, int64_t col_stride,
                                       int row0, int nvalid, int tid, int nlo = 0) {
    const int r = tid / M::CPR;
    const int blk = ((tid % M::CPR) * 16) / 32;  // Q8_0 block of the chunk's 16 codes
    const __half* p = s + int64_t(row0 + r) * row_stride + int64_t(blk) * col_stride;
    const int64_t step = int64_t(M::RPI) * row_stride;
#pragma unroll
    for (int i = 0; i < M::ITERS; ++i) {
      const int row = row0 + r + i * M::RPI;
      const bool ok = M::has(tid, i) && row < nvalid && row >= nlo;
      v[i] = ok ? __half2float(*p) : 0.0f;
      p += step;
    }
  }
};

// 16 Q8_0 codes at src (16-byte aligned shared) times d, rounded once to T, stored at dst. The
// codes become floats four at a time with i8x4_to_float4 (byte permute into the 2^23 magic and
// one FADD: exact, no I2F, a quarter-rate instruction on sm_80/sm_90).
template <typename T>
__device__ __forceinline__ void dequant16(const int8_t* src, float d, T* dst) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  float c[16];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 f = bricks::i8x4_to_float4(words[j]);
    c[4 * j] = f.x;
    c[4 * j + 1] = f.y;
    c[4 * j + 2] = f.z;
    c[4 * j + 3] = f.w;
  }
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float4 f = make_float4(c[4 * j] * d, c[4 * j + 1] * d, c[4 * j + 2] * d,
                             c[4 * j + 3] * d);
      reinterpret_cast<float4*>(dst)[j] = f;
    }
  } else {
    uint32_t w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      w[j] = pack2<T>(c[2 * j] * d, c[2 * j + 1] * d);
    }
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// Dequantize a staged BK x D code tile (row stride D) into the T tile (row stride LDS) with
// this thread's scales.
template <typename T, int BK, int D, int LDS, int NT>
__device__ __forceinline__ void dequant_tile(const int8_t* codes, const Q8Scales<BK, D, NT>& sc,
                                             T* dst, int tid) {
  using M = typename Q8Scales<BK, D, NT>::M;
  const int r = tid / M::CPR;
  const int col = (tid % M::CPR) * 16;
#pragma unroll
  for (int i = 0; i < M::ITERS; ++i) {
    if (M::has(tid, i)) {
      const int row = r + i * M::RPI;
      dequant16<T>(codes + row * D + col, sc.v[i], dst + row * LDS + col);
    }
  }
}

}  // namespace attn
}  // namespace bricks

#endif  // MLX_BRICKS_ATTENTION_STAGE_CUH
