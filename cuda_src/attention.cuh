// attention.cuh -- the CUDA twin of the FlashAttention prefill brick (body: attention.cu).
// Needs mma.cuh before it.
//
// Algorithm: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning"): a block takes BQ query rows of one (batch, head), K/V
// tiles of BK keys stream through shared memory, the softmax is rescaled online in float32 and
// no score matrix ever leaves registers. Written from the paper and the PTX ISA.
//
// Block = 4 row groups x NSPLIT head-dim slices warps (NSPLIT = 2 only for D = 512). The warp of
// row group rg and slice dh owns query rows rg * 16 * MT .. + 16 * MT - 1 of the block (MT
// m16 tiles) and output columns dh * DW .. dh * DW + DW - 1 (DW = D / NSPLIT).
//
//   fp16 / bf16: S = Q K^T and O += P V on mma.sync m16n8k16 (f32 accumulators). Q fragments
//     come from shared memory by ldmatrix (kept in registers when QREG), K fragments by
//     ldmatrix (keys are the n axis, head_dim contiguous = "col" B), V fragments by
//     ldmatrix.trans. P is the S accumulator converted in registers: the C layout of two
//     n8 blocks is the A layout of one k16 step.
//   float32: the same tiles and softmax, S and O by plain FFMA from shared memory (exact float32
//     products; tensor-core TF32 or split-bf16 products are not float32 accurate).
//
// D = 512 (NSPLIT = 2): a warp pair shares 16 rows; each warp computes the partial S over its
// half of head_dim, the pair exchanges partials through shared memory (S = S_lo + S_hi, the
// same float sum in both warps), both run the identical softmax, and each accumulates P V for
// its half of the output columns. No QK^T work is duplicated; the O accumulator stays at
// 256 / 2 = 128 floats per thread.
//
// Pipeline per K/V tile t (one K and one V buffer, as FlashAttention-2):
//   wait K_t; sync | issue V_t | S = Q K_t; softmax | wait V_t; sync | issue K_t+1 | O += P V_t
// so the V load hides behind S and the next K load behind P V. Q8_0 K/V stage the int8 codes
// (cp.async) and take the half scales into registers one tile ahead, then dequantize
// q * d -> T into the same K/V tiles (the values the MSL brick attends over).
#ifndef MLX_BRICKS_ATTENTION_CUH
#define MLX_BRICKS_ATTENTION_CUH

namespace bricks {
namespace attn {

// log2(e): scores are kept in the log2 domain so the softmax uses exp2.
constexpr float kLog2e = 1.4426950408889634f;
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
constexpr float kMasked = -3.4028234663852886e38f;

// PTX-only helpers; tests/cuda_emu/warp_emu.h supplies host versions (BRICKS_HOST_EMULATION)
// to run this kernel on the CPU.
#ifndef BRICKS_HOST_EMULATION
// 2^x, ex2.approx.ftz (max relative error 2^-22; subnormal results flush to 0).
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Named barrier over `nthreads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}
#endif  // BRICKS_HOST_EMULATION

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

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

// ---- Which keys a row sees, which tiles a block loads, which tiles a warp computes/masks ----
// (__host__ too: tests/test_attention_cuda.py checks them exhaustively on the CPU.)
// A query row at key position pos = row + Lk - Lq sees key j iff kv_lo <= j < Lk, and j <= pos
// when `upper` (causal; a window implies it), and j > pos - window when has_window. kv_lo: the
// batch row's first valid key (KV_START, a left-padded batch; 0 otherwise), in 0 .. Lk.
__host__ __device__ __forceinline__ bool key_visible(int key, int pos, int Lk, bool upper,
                                                     bool has_window, int window,
                                                     int kv_lo = 0) {
  return key >= kv_lo && key >= 0 && key < Lk && (!upper || key <= pos) &&
         (!has_window || key > pos - window);
}

__host__ __device__ __forceinline__ int clamp_int(int x, int lo, int hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// K/V tiles [t_begin, t_end) of BK keys that rows row0 .. row_last may see; later and (with a
// window or kv_lo) earlier tiles are never loaded.
struct TileRange {
  int t_begin, t_end;
};

__host__ __device__ __forceinline__ TileRange block_tiles(int row0, int row_last, int diag,
                                                          int Lk, int BK, bool upper,
                                                          bool has_window, int window,
                                                          int kv_lo = 0) {
  const int hi = upper ? clamp_int(row_last + diag + 1, 0, Lk) : Lk;
  int lo = has_window ? clamp_int(row0 + diag - window + 1, 0, hi) : 0;
  if (kv_lo > lo) lo = kv_lo < hi ? kv_lo : hi;
  const int tb = lo / BK;
  return TileRange{tb, hi > lo ? (hi + BK - 1) / BK : tb};
}

// Whether rows row0 .. row_last see any key of tile [kv0, kv0 + BK) (else the warp skips it).
__host__ __device__ __forceinline__ bool tile_active(int kv0, int BK, int row0, int row_last,
                                                     int diag, bool upper, bool has_window,
                                                     int window, int kv_lo = 0) {
  return !(upper && kv0 > row_last + diag) &&
         !(has_window && kv0 + BK - 1 <= row0 + diag - window) && kv0 + BK > kv_lo;
}

// Whether some row of row0 .. row_last does not see some key of the tile (else no mask).
__host__ __device__ __forceinline__ bool tile_needs_mask(int kv0, int BK, int row0,
                                                         int row_last, int diag, int Lk,
                                                         bool upper, bool has_window,
                                                         int window, int kv_lo = 0) {
  return kv0 + BK > Lk || (upper && kv0 + BK - 1 > row0 + diag) ||
         (has_window && kv0 <= row_last + diag - window) || kv0 < kv_lo;
}

// The run-time parameters of one (batch row b, head h): the window, the first valid key (kv_lo,
// clamped to 0 .. Lk), the score mapping to the log2 domain (s * pre, or tanh(s * pre) * post
// with soft-capping: s * scale * log2 e, or softcap * tanh(s * scale / softcap) * log2 e) and
// the sink's score in that domain (neither scaled nor capped). fparams = (scale, softcap,
// 1 / softcap), iparams = (window,); kv_start and sinks are read only when their flag is set.
template <bool WINDOW, bool SOFTCAP, bool KV_START, bool SINKS>
struct RunParams {
  int window, kv_lo;
  float pre, post, sink2;
  __device__ __forceinline__ RunParams(const float* fparams, const int32_t* iparams,
                                       const int32_t* kv_start, int64_t kv_start_stride,
                                       const float* sinks, int64_t sinks_stride, int b, int h,
                                       int Lk) {
    const float scale = fparams[0];
    const float softcap = SOFTCAP ? fparams[1] : 1.0f;
    window = WINDOW ? iparams[0] : 0;
    kv_lo = KV_START ? clamp_int(kv_start[int64_t(b) * kv_start_stride], 0, Lk) : 0;
    pre = SOFTCAP ? scale / softcap : scale * kLog2e;
    post = softcap * kLog2e;
    sink2 = SINKS ? sinks[int64_t(h) * sinks_stride] * kLog2e : 0.0f;
  }
};

// The compile-time shape of one kernel variant. mlx_bricks/ops/attention_cuda.py mirrors the
// shared-memory layout (smem_bytes) and the kernel traps if launched with less.
template <typename T, int D, int BK, int MT, bool KV_Q8>
struct Config {
  static constexpr int NSPLIT = D > 256 ? 2 : 1;  // head_dim slices per row group
  static constexpr int DW = D / NSPLIT;           // head_dim columns per warp
  static constexpr int NW = 4 * NSPLIT;           // warps per block
  static constexpr int NT = 32 * NW;              // threads per block
  static constexpr int BQ = 64 * MT;              // query rows per block (4 row groups)
  static constexpr int WR = 16 * MT;              // query rows per warp
  static constexpr int E = int(sizeof(T));
  static constexpr bool F32 = E == 4;
  static constexpr int PAD = 16 / E;              // +16 bytes per row: conflict-free ldmatrix
  static constexpr int LDS = D + PAD;             // row stride of the Q, K, V tiles (elements)
  static constexpr int LDP = BK + 2;              // float32 P tile row stride (even, conflict-free)

  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + BQ * LDS * E;
  static constexpr int V_OFF = K_OFF + BK * LDS * E;
  static constexpr int KR_OFF = V_OFF + BK * LDS * E;  // Q8_0 codes of K (BK x D int8)
  static constexpr int VR_OFF = KR_OFF + (KV_Q8 ? BK * D : 0);
  static constexpr int X_OFF = VR_OFF + (KV_Q8 ? BK * D : 0);  // partial S of each warp
  static constexpr int X_FLOATS = MT * (BK / 8) * 4 * 32;        // per warp, fragment order
  static constexpr int P_OFF = X_OFF + (NSPLIT > 1 ? NW * X_FLOATS * 4 : 0);
  static constexpr int P_FLOATS = 16 * LDP;                       // per warp (float32 path)
  static constexpr int SMEM = P_OFF + (F32 ? NW * P_FLOATS * 4 : 0);

  static_assert(D % 16 == 0 && DW % 16 == 0, "head_dim must be a multiple of 16 (32 for D = 512)");
  static_assert(BK % 16 == 0 && BK >= 16, "BK must be a positive multiple of 16");
  static_assert(MT == 1 || MT == 2, "MT (m16 tiles per warp) must be 1 or 2");
  static_assert(!F32 || MT == 1, "the float32 path runs MT = 1");
  static_assert(!KV_Q8 || D % 32 == 0, "Q8_0 K/V needs head_dim % 32 == 0");
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

// Strides of one (B, H, L, D) input, in elements.
struct Strides4 {
  int64_t b, h, l, d;
};

struct Dims {
  int Hq, Lq, Hkv, Lk;
};

// ---- The per-tile steps of the kernel, one function each (the kernel below strings them
// together; every path, fp16/bf16 tensor cores or float32 FFMA, split head_dim or not, is a
// branch inside a step, not a copy of the loop). Fragment layouts: mma.cuh.

// Per-lane shared addresses of the ldmatrix sources; the steps add compile-time offsets (so no
// per-fragment address stays live across the key loop).
struct LdmBases {
  uint32_t q, k, v;
};

template <class C>
__device__ __forceinline__ LdmBases ldm_bases(const unsigned char* smem, int rg, int dcol0,
                                              int lane) {
  constexpr int LDS = C::LDS;
  LdmBases b;
  b.q = smem_addr(smem + C::Q_OFF) +
        uint32_t(((rg * C::WR + lane % 16) * LDS + dcol0 + (lane / 16) * 8) * C::E);
  b.k = smem_addr(smem + C::K_OFF) +
        uint32_t((((lane / 16) * 8 + lane % 8) * LDS + dcol0 + ((lane / 8) % 2) * 8) * C::E);
  b.v = smem_addr(smem + C::V_OFF) +
        uint32_t(((lane % 16) * LDS + dcol0 + (lane / 16) * 8) * C::E);
  return b;
}

// Step: Q's A fragments of m16 tile m, k16 chunk kc (from registers with QREG, else ldmatrix).
template <class C, bool QREG, int QM, int QK>
__device__ __forceinline__ void q_fragment(const uint32_t (&qf)[QM][QK][4], uint32_t q_lm, int m,
                                           int kc, uint32_t (&qa)[4]) {
  if constexpr (QREG) {
#pragma unroll
    for (int e = 0; e < 4; ++e) qa[e] = qf[m][kc][e];
  } else {
    ldmatrix_x4(qa, q_lm + uint32_t((m * 16 * C::LDS + kc * 16) * C::E));
  }
}

// Step 1: S = Q K^T over this warp's head_dim slice (s zeroed first). fp16/bf16: mma.sync with
// K fragments by ldmatrix; float32: FFMA from shared memory (MT = 1).
template <class C, typename T, int BK, int MT, bool QREG, int QM, int QK>
__device__ __forceinline__ void qk_tile(float (&s)[MT][BK / 8][4],
                                        const uint32_t (&qf)[QM][QK][4], const LdmBases& lm,
                                        const unsigned char* smem, int rg, int dcol0, int g,
                                        int tq) {
  constexpr int NB = BK / 8;
  constexpr int DW = C::DW;
  constexpr int LDS = C::LDS;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[m][j][e] = 0.0f;
  if constexpr (C::F32) {
    const float* qa_row =
        reinterpret_cast<const float*>(smem + C::Q_OFF) + (rg * 16 + g) * LDS + dcol0;
    const float* kt = reinterpret_cast<const float*>(smem + C::K_OFF) + dcol0;
#pragma unroll 2
    for (int d = 0; d < DW; d += 4) {
      const float4 qa = *reinterpret_cast<const float4*>(qa_row + d);
      const float4 qb = *reinterpret_cast<const float4*>(qa_row + 8 * LDS + d);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const float4 k0 = *reinterpret_cast<const float4*>(kt + (j * 8 + 2 * tq) * LDS + d);
        const float4 k1 = *reinterpret_cast<const float4*>(kt + (j * 8 + 2 * tq + 1) * LDS + d);
        float* sj = s[0][j];
        sj[0] = fmaf(qa.x, k0.x, sj[0]); sj[0] = fmaf(qa.y, k0.y, sj[0]);
        sj[0] = fmaf(qa.z, k0.z, sj[0]); sj[0] = fmaf(qa.w, k0.w, sj[0]);
        sj[1] = fmaf(qa.x, k1.x, sj[1]); sj[1] = fmaf(qa.y, k1.y, sj[1]);
        sj[1] = fmaf(qa.z, k1.z, sj[1]); sj[1] = fmaf(qa.w, k1.w, sj[1]);
        sj[2] = fmaf(qb.x, k0.x, sj[2]); sj[2] = fmaf(qb.y, k0.y, sj[2]);
        sj[2] = fmaf(qb.z, k0.z, sj[2]); sj[2] = fmaf(qb.w, k0.w, sj[2]);
        sj[3] = fmaf(qb.x, k1.x, sj[3]); sj[3] = fmaf(qb.y, k1.y, sj[3]);
        sj[3] = fmaf(qb.z, k1.z, sj[3]); sj[3] = fmaf(qb.w, k1.w, sj[3]);
      }
    }
  } else {
#pragma unroll
    for (int kc = 0; kc < DW / 16; ++kc) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) q_fragment<C, QREG>(qf, lm.q, m, kc, qa[m]);
#pragma unroll
      for (int jp = 0; jp < BK / 16; ++jp) {
        uint32_t kb[4];
        ldmatrix_x4(kb, lm.k + uint32_t((jp * 16 * LDS + kc * 16) * C::E));
        const uint32_t b0[2] = {kb[0], kb[1]};
        const uint32_t b1[2] = {kb[2], kb[3]};
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_16816<T>(s[m][2 * jp], qa[m], b0);
          mma_16816<T>(s[m][2 * jp + 1], qa[m], b1);
        }
      }
    }
  }
}

// Step 2 (D = 512 only): add the partner warp's partial S through shared memory (the same float
// sum in both warps of the pair, one named barrier per row group).
template <class C, int BK, int MT>
__device__ __forceinline__ void add_partner_scores(float (&s)[MT][BK / 8][4],
                                                   unsigned char* smem, int warp, int rg,
                                                   int lane) {
  constexpr int NB = BK / 8;
  float* sx = reinterpret_cast<float*>(smem + C::X_OFF);
  float* mine = sx + warp * C::X_FLOATS;
  const float* other = sx + (warp ^ 4) * C::X_FLOATS;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[((m * NB + j) * 4 + e) * 32 + lane] = s[m][j][e];
  named_barrier(1 + rg, 64);
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[m][j][e] += other[((m * NB + j) * 4 + e) * 32 + lane];
}

// Step 3: scores to the log2 domain (scale, soft-cap), mask (only when the tile needs it), and
// the online softmax update: s becomes P, m_run / l_run are updated and factor is what O must
// be multiplied by (softmax_tile does it; the fast family may do it later, once its in-flight
// P V has completed). FAST (only for a tile without soft-cap or mask and with pre > 0; the
// caller branches once per tile, so no score pays for both forms): the row max is taken over the
// raw scores and p = 2^(s pre - m) is one FFMA and one ex2 per score.
template <bool F32, bool SOFTCAP, bool UPPER, bool WINDOW, int BK, int MT, bool FAST = false>
__device__ __forceinline__ void softmax_probs(float (&s)[MT][BK / 8][4], float (&m_run)[MT][2],
                                              float (&l_run)[MT][2], float (&factor)[MT][2],
                                              float pre, float post, bool need_mask, int wrow0,
                                              int diag, int kv0, int Lk, int window, int kv_lo,
                                              int g, int tq) {
  constexpr int NB = BK / 8;
  static_assert(!FAST || (!SOFTCAP && !F32), "the FFMA form is for unmasked, uncapped tiles");
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float mx[2] = {m_run[m][0], m_run[m][1]};
    if constexpr (FAST) {
      float raw[2] = {kMasked, kMasked};
#pragma unroll
      for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) raw[e / 2] = fmaxf(raw[e / 2], s[m][j][e]);
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = fmaxf(mx[r], quad_max(raw[r]) * pre);
    } else {
#pragma unroll
      for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = SOFTCAP ? tanhf(s[m][j][e] * pre) * post : s[m][j][e] * pre;
          if (need_mask) {
            const int pos = wrow0 + m * 16 + g + (e / 2) * 8 + diag;  // key position of the row
            const int key = kv0 + j * 8 + 2 * tq + (e % 2);
            x = key_visible(key, pos, Lk, UPPER, WINDOW, window, kv_lo) ? x : kMasked;
          }
          s[m][j][e] = x;
          mx[e / 2] = fmaxf(mx[e / 2], x);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = quad_max(mx[r]);
    }
    bool live[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      live[r] = mx[r] > kMasked;  // the row has seen a visible key
      factor[m][r] = F32 ? exp2f(m_run[m][r] - mx[r]) : exp2_fast(m_run[m][r] - mx[r]);
      m_run[m][r] = mx[r];
    }
    float lsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p;
        if constexpr (FAST) {
          p = exp2_fast(fmaf(s[m][j][e], pre, -mx[e / 2]));
        } else {
          const float d = s[m][j][e] - mx[e / 2];
          p = live[e / 2] ? (F32 ? exp2f(d) : exp2_fast(d)) : 0.0f;
        }
        s[m][j][e] = p;
        lsum[e / 2] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[m][r] = l_run[m][r] * factor[m][r] + lsum[r];
  }
}

// O *= factor, row by row (the C layout: elements 0, 1 of row g, 2, 3 of row g + 8).
template <int MT, int ND>
__device__ __forceinline__ void rescale_o(float (&o)[MT][ND][4], const float (&factor)[MT][2]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < ND; ++i) {
      o[m][i][0] *= factor[m][0];
      o[m][i][1] *= factor[m][0];
      o[m][i][2] *= factor[m][1];
      o[m][i][3] *= factor[m][1];
    }
}

template <bool F32, bool SOFTCAP, bool UPPER, bool WINDOW, int BK, int MT, int ND>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][BK / 8][4], float (&m_run)[MT][2],
                                             float (&l_run)[MT][2], float (&o)[MT][ND][4],
                                             float pre, float post, bool need_mask, int wrow0,
                                             int diag, int kv0, int Lk, int window, int kv_lo,
                                             int g, int tq) {
  float factor[MT][2];
  softmax_probs<F32, SOFTCAP, UPPER, WINDOW, BK, MT>(s, m_run, l_run, factor, pre, post,
                                                     need_mask, wrow0, diag, kv0, Lk, window,
                                                     kv_lo, g, tq);
  rescale_o<MT, ND>(o, factor);
}

// Step 4: O += P V over this warp's head_dim slice. fp16/bf16: P is the S accumulator packed to
// A fragments in registers, V fragments by ldmatrix.trans; float32: P staged per warp in shared
// memory, FFMA.
template <class C, typename T, int BK, int MT, int ND>
__device__ __forceinline__ void pv_tile(float (&o)[MT][ND][4], const float (&s)[MT][BK / 8][4],
                                        const LdmBases& lm, unsigned char* smem, int warp,
                                        int dcol0, int g, int tq) {
  constexpr int NB = BK / 8;
  constexpr int DW = C::DW;
  constexpr int LDS = C::LDS;
  if constexpr (C::F32) {
    float* sp = reinterpret_cast<float*>(smem + C::P_OFF) + warp * C::P_FLOATS;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      *reinterpret_cast<float2*>(sp + g * C::LDP + j * 8 + 2 * tq) =
          make_float2(s[0][j][0], s[0][j][1]);
      *reinterpret_cast<float2*>(sp + (g + 8) * C::LDP + j * 8 + 2 * tq) =
          make_float2(s[0][j][2], s[0][j][3]);
    }
    __syncwarp();
    const float* vt = reinterpret_cast<const float*>(smem + C::V_OFF) + dcol0 + 2 * tq;
#pragma unroll 2
    for (int c = 0; c < BK; ++c) {
      const float p0 = sp[g * C::LDP + c];
      const float p1 = sp[(g + 8) * C::LDP + c];
#pragma unroll
      for (int i = 0; i < ND; ++i) {
        const float2 vv = *reinterpret_cast<const float2*>(vt + c * LDS + i * 8);
        o[0][i][0] = fmaf(p0, vv.x, o[0][i][0]);
        o[0][i][1] = fmaf(p0, vv.y, o[0][i][1]);
        o[0][i][2] = fmaf(p1, vv.x, o[0][i][2]);
        o[0][i][3] = fmaf(p1, vv.y, o[0][i][3]);
      }
    }
    __syncwarp();  // P is read before the next tile overwrites it
  } else {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        pa[m][0] = pack2<T>(s[m][2 * kk][0], s[m][2 * kk][1]);
        pa[m][1] = pack2<T>(s[m][2 * kk][2], s[m][2 * kk][3]);
        pa[m][2] = pack2<T>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
        pa[m][3] = pack2<T>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dn = 0; dn < DW / 16; ++dn) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, lm.v + uint32_t((kk * 16 * LDS + dn * 16) * C::E));
        const uint32_t b0[2] = {vb[0], vb[1]};
        const uint32_t b1[2] = {vb[2], vb[3]};
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_16816<T>(o[m][2 * dn], pa[m], b0);
          mma_16816<T>(o[m][2 * dn + 1], pa[m], b1);
        }
      }
    }
  }
}

// Step 5: out[b, row, h, :] = O / l for this warp's rows and columns; a row that saw no key
// gives 0.
template <class C, typename T, int D, int MT, int ND>
__device__ __forceinline__ void store_rows(T* out, const float (&o)[MT][ND][4],
                                           const float (&l_run)[MT][2], int64_t b, int h,
                                           int Lq, int Hq, int wrow0, int dcol0, int g, int tq) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[m][r]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = wrow0 + m * 16 + g + 8 * r;
      if (row < Lq) {
        T* dst = out + ((b * Lq + row) * Hq + h) * D + dcol0 + 2 * tq;
#pragma unroll
        for (int i = 0; i < ND; ++i) {
          const float x0 = o[m][i][2 * r] * inv;
          const float x1 = o[m][i][2 * r + 1] * inv;
          if constexpr (C::F32) {
            *reinterpret_cast<float2*>(dst + i * 8) = make_float2(x0, x1);
          } else {
            *reinterpret_cast<uint32_t*>(dst + i * 8) = pack2<T>(x0, x1);
          }
        }
      }
    }
  }
}

// The whole kernel. T: dtype of q/out (and k/v unless KV_Q8); KT: element type of k/v as
// given (T, or int8_t codes). fparams = (scale, softcap, 1 / softcap), iparams = (window,)
// (the MSL brick's parameter inputs; 1 / softcap is not used here). KV_START: kv_start (B,)
// int32 (element stride kv_start_stride) holds batch row b's first valid key, clamped to
// 0 .. Lk: tiles below it are never loaded, the partial tile is masked and its padding keys are
// staged as zeros (never read: NaN there cannot reach O). Without KV_START it is not read.
// SINKS: sinks (Hq,) float (element stride sinks_stride) holds head h's sink logit, one more
// softmax column with value 0 (gpt-oss): each row starts from it already seen, m = sink (in
// the log2 domain, sink * log2 e) and l = 1 (in the quad's first lane only: l_run holds
// per-lane partial sums, quad-summed at the end); without SINKS it is not read.
template <typename T, int D, int BK, int MT, bool QREG, bool CAUSAL, bool WINDOW,
          bool SOFTCAP, bool KV_Q8, bool KV_START, bool SINKS, typename KT>
__device__ __forceinline__ void flash_attention_fwd(
    const T* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
    const __half* __restrict__ k_scale, const __half* __restrict__ v_scale,
    const float* __restrict__ fparams, const int32_t* __restrict__ iparams,
    const int32_t* __restrict__ kv_start, int64_t kv_start_stride,
    const float* __restrict__ sinks, int64_t sinks_stride,
    T* __restrict__ out, Dims dims, Strides4 qs, Strides4 ks,
    Strides4 vs, Strides4 kss, Strides4 vss, unsigned char* smem) {
  using C = Config<T, D, BK, MT, KV_Q8>;
  constexpr int DW = C::DW;
  constexpr int LDS = C::LDS;
  constexpr int NT = C::NT;
  constexpr int NB = BK / 8;   // n8 blocks of keys in S
  constexpr int ND = DW / 8;   // n8 blocks of head_dim in O
  constexpr bool UPPER = CAUSAL || WINDOW;  // a window implies causal (p - window < j <= p)
  static_assert(!QREG || (C::NSPLIT == 1 && !C::F32), "QREG needs the 16-bit, unsplit path");
  static_assert(KV_Q8 ? sizeof(KT) == 1 : sizeof(KT) == sizeof(T), "k/v element type");

  if (dynamic_smem_bytes() < uint32_t(C::SMEM)) {
    __trap();  // launched with less shared memory than this variant lays out
  }

  T* sQ = reinterpret_cast<T*>(smem + C::Q_OFF);
  T* sK = reinterpret_cast<T*>(smem + C::K_OFF);
  T* sV = reinterpret_cast<T*>(smem + C::V_OFF);

  const int tid = int(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;   // fragment row group
  const int tq = lane % 4;  // fragment column pair
  const int rg = warp % 4;  // row group
  const int dh = warp / 4;  // head_dim slice
  const int dcol0 = dh * DW;

  const int qblock = int(gridDim.x) - 1 - int(blockIdx.x);  // heaviest causal blocks first
  const int h = int(blockIdx.y);
  const int b = int(blockIdx.z);
  const int Lq = dims.Lq;
  const int Lk = dims.Lk;
  const int hk = h / (dims.Hq / dims.Hkv);  // GQA
  const int diag = Lk - Lq;                 // query row i sits at key position i + diag
  const int q0 = qblock * C::BQ;
  const int wrow0 = q0 + rg * C::WR;        // this warp's first query row

  const RunParams<WINDOW, SOFTCAP, KV_START, SINKS> rp(fparams, iparams, kv_start,
                                                       kv_start_stride, sinks, sinks_stride, b,
                                                       h, Lk);
  const int window = rp.window, kv_lo = rp.kv_lo;
  const float pre = rp.pre, post = rp.post, sink2 = rp.sink2;

  // Keys any row of the block may see: tiles outside are never loaded.
  const TileRange tiles =
      block_tiles(q0, min(q0 + C::BQ, Lq) - 1, diag, Lk, BK, UPPER, WINDOW, window, kv_lo);
  const int t_begin = tiles.t_begin;
  const int t_end = tiles.t_end;

  const T* qg = q + int64_t(b) * qs.b + int64_t(h) * qs.h;
  const KT* kg = k + int64_t(b) * ks.b + int64_t(hk) * ks.h;
  const KT* vg = v + int64_t(b) * vs.b + int64_t(hk) * vs.h;
  const bool q_fast = qs.d == 1 && (qs.l * int64_t(sizeof(T))) % 16 == 0 && aligned16(qg);
  const bool k_fast = ks.d == 1 && (ks.l * int64_t(sizeof(KT))) % 16 == 0 && aligned16(kg);
  const bool v_fast = vs.d == 1 && (vs.l * int64_t(sizeof(KT))) % 16 == 0 && aligned16(vg);

  // Stage loaders.
  int8_t* sKr = reinterpret_cast<int8_t*>(smem + C::KR_OFF);
  int8_t* sVr = reinterpret_cast<int8_t*>(smem + C::VR_OFF);
  const __half* ksg = k_scale + (KV_Q8 ? int64_t(b) * kss.b + int64_t(hk) * kss.h : 0);
  const __half* vsg = v_scale + (KV_Q8 ? int64_t(b) * vss.b + int64_t(hk) * vss.h : 0);
  Q8Scales<BK, D, NT> k_sc, v_sc;

  auto issue_k = [&](int t) {
    if constexpr (KV_Q8) {
      copy_tile<int8_t, BK, D, D, NT>(sKr, reinterpret_cast<const int8_t*>(kg), ks.l, ks.d,
                                      t * BK, Lk, k_fast, tid, kv_lo);
      k_sc.load(ksg, kss.l, kss.d, t * BK, Lk, tid, kv_lo);
    } else {
      copy_tile<T, BK, D, LDS, NT>(sK, reinterpret_cast<const T*>(kg), ks.l, ks.d, t * BK, Lk,
                                   k_fast, tid, kv_lo);
    }
  };
  auto issue_v = [&](int t) {
    if constexpr (KV_Q8) {
      copy_tile<int8_t, BK, D, D, NT>(sVr, reinterpret_cast<const int8_t*>(vg), vs.l, vs.d,
                                      t * BK, Lk, v_fast, tid, kv_lo);
      v_sc.load(vsg, vss.l, vss.d, t * BK, Lk, tid, kv_lo);
    } else {
      copy_tile<T, BK, D, LDS, NT>(sV, reinterpret_cast<const T*>(vg), vs.l, vs.d, t * BK, Lk,
                                   v_fast, tid, kv_lo);
    }
  };

  // Prologue: Q and the first K (and V when Q8_0) tile.
  copy_tile<T, C::BQ, D, LDS, NT>(sQ, qg, qs.l, qs.d, q0, Lq, q_fast, tid);
  if (t_begin < t_end) {
    issue_k(t_begin);
    if constexpr (KV_Q8) {
      issue_v(t_begin);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const LdmBases lm = ldm_bases<C>(smem, rg, dcol0, lane);

  // Q fragments held in registers (QREG) for the whole key loop.
  constexpr int QM = QREG ? MT : 1;
  constexpr int QK = QREG ? DW / 16 : 1;
  uint32_t qf[QM][QK][4];
  if constexpr (QREG) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int kc = 0; kc < DW / 16; ++kc) {
        ldmatrix_x4(qf[m][kc], lm.q + uint32_t((m * 16 * LDS + kc * 16) * C::E));
      }
    }
  }

  float o[MT][ND][4];
  float m_run[MT][2];
  float l_run[MT][2];  // per-thread partial row sums (quad-reduced at the end)
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int i = 0; i < ND; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[m][i][e] = 0.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[m][r] = SINKS ? sink2 : kMasked;
      l_run[m][r] = SINKS && tq == 0 ? 1.0f : 0.0f;
    }
  }

  const int wlast = min(wrow0 + C::WR, Lq) - 1;  // this warp's last live row
  const bool warp_live = wrow0 < Lq;

  for (int t = t_begin; t < t_end; ++t) {
    const int kv0 = t * BK;
    if constexpr (KV_Q8) {
      if (t > t_begin) {
        cp_async_wait<0>();
        __syncthreads();  // codes of tile t landed; every warp is done with sK/sV of t - 1
      }
      dequant_tile<T, BK, D, LDS, NT>(sKr, k_sc, sK, tid);
      dequant_tile<T, BK, D, LDS, NT>(sVr, v_sc, sV, tid);
      __syncthreads();  // sK/sV of tile t ready; the code buffers are free
      if (t + 1 < t_end) {
        issue_k(t + 1);
        issue_v(t + 1);
      }
      cp_async_commit();
    } else {
      if (t > t_begin) {
        cp_async_wait<0>();
        __syncthreads();  // K_t landed; every warp is done with P V_{t-1}, so sV is free
      }
      issue_v(t);
      cp_async_commit();
    }

    // A warp whose rows see no key of this tile skips it (uniform in the warp and the pair).
    const bool active =
        warp_live && tile_active(kv0, BK, wrow0, wlast, diag, UPPER, WINDOW, window, kv_lo);
    // Only tiles that cross Lk, the diagonal, the window edge or kv_lo need the per-element
    // mask.
    const bool need_mask =
        tile_needs_mask(kv0, BK, wrow0, wlast, diag, Lk, UPPER, WINDOW, window, kv_lo);

    float s[MT][NB][4];
    if (active) {
      qk_tile<C, T, BK, MT, QREG>(s, qf, lm, smem, rg, dcol0, g, tq);
      if constexpr (C::NSPLIT > 1) {
        add_partner_scores<C, BK, MT>(s, smem, warp, rg, lane);
      }
      softmax_tile<C::F32, SOFTCAP, UPPER, WINDOW, BK, MT, ND>(
          s, m_run, l_run, o, pre, post, need_mask, wrow0, diag, kv0, Lk, window, kv_lo, g, tq);
    }

    // V_t landed and every warp is done reading sK: start K_{t+1} behind P V_t.
    if constexpr (!KV_Q8) {
      cp_async_wait<0>();
      __syncthreads();
      if (t + 1 < t_end) {
        issue_k(t + 1);
      }
      cp_async_commit();
    }

    if (active) {
      pv_tile<C, T, BK, MT, ND>(o, s, lm, smem, warp, dcol0, g, tq);
    }
  }
  cp_async_wait<0>();  // nothing may stay in flight past the kernel's end

  store_rows<C, T, D, MT, ND>(out, o, l_run, int64_t(b), h, Lq, dims.Hq, wrow0, dcol0, g, tq);
}

}  // namespace attn
}  // namespace bricks

#endif  // MLX_BRICKS_ATTENTION_CUH
