// gemm.cuh -- the CUDA twin of metal_src/gemm.h: one ingestion pipeline for every GEMM brick.
// Needs mma.cuh and dequant.cuh before it (the registry concatenates cuda_headers in order).
//
// C (M x N) = A (M x K) * B^T, B in the nn.Linear layout (N rows of K), FP32 accumulators on
// mma.sync m16n8k16 tensor cores (sm_80+). A kernel body picks:
//
//   GemmConfig<T, BM, BN, WM, WN, NB, STAGES>   block tile BM x (NB * BN), WM x WN warps; NB = 1
//                                               for a GEMM, 2 for the fused SwiGLU (gate and up
//                                               share each A tile); STAGES-deep cp.async ring.
//   ALoader                                     activations (M, K) row-major -> swizzled tile,
//                                               16-byte cp.async, or predicated scalar loads when
//                                               K % 8 != 0 or the rows are not 16-byte aligned.
//   FloatB / AffineB<BITS, GS>                  the weight loaders: 16-bit weights land as the
//                                               MMA operand; MLX affine weights (uint32 packed,
//                                               scales, biases) land packed and are dequantized
//                                               ONCE per staged tile into a 16-bit tile (never per
//                                               MMA), one stage ahead of the MMAs.
//   gemm_mainloop(...)                          the K loop: one barrier per K step.
//   WarpTile::for_each(op)                      the epilogue walk: op(acc, b, row, col) per pair
//                                               of adjacent columns.
//
// Shared-memory tiles hold BK = 64 16-bit values per row (128 bytes, eight 16-byte chunks);
// chunk c of row r lives at chunk c ^ (r & 7), so the eight rows an ldmatrix phase reads hit
// eight different bank groups (conflict-free), and so do the cp.async stores.
//
// Rows past M (A) are zero-filled; rows past N (B) are zero-filled / clamped and never stored;
// K past the end is zero in A, so B there only needs to be finite.
//
// Sources: the Ampere GEMM structure of CUTLASS (multistage cp.async, ldmatrix, mma.sync) and
// MLX's steel GEMM (loader / MMA / epilogue as separate pieces); affine format of MLX
// (mlx/backend/metal/kernels/quantized.h): value = scale * q + bias per group.
#ifndef MLX_BRICKS_GEMM_CUH
#define MLX_BRICKS_GEMM_CUH

namespace bricks {

constexpr int GEMM_BK = 64;          // K per stage: 64 16-bit values = 128-byte rows
constexpr int GEMM_CHUNKS = 8;       // 16-byte chunks per tile row

// Byte offset of chunk c of row r in a swizzled tile.
__device__ __forceinline__ int swz(int r, int c) { return (r * GEMM_CHUNKS + (c ^ (r & 7))) * 16; }

// DEPTH_: wgmma groups kept in flight across K steps (0 or 1; mma.sync is always 0). With 1 the
// tensor cores always have the next stage queued; the ring then prefetches one stage less and
// the affine path keeps three dequantized tiles instead of two.
template <typename T_, int BM_, int BN_, int WM_, int WN_, int NB_, int STAGES_, int DEPTH_ = 0>
struct GemmConfig {
  using T = T_;
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;        // rows of EACH B operand
  static constexpr int WM = WM_;
  static constexpr int WN = WN_;
  static constexpr int NB = NB_;        // B operands sharing the A tile
  static constexpr int STAGES = STAGES_;
  static constexpr int DEPTH = DEPTH_;
  static constexpr int DQ_TILES = 2 + DEPTH_;  // dequantized operand tiles (affine weights)
  static constexpr int BK = GEMM_BK;
  static constexpr int THREADS = WM * WN * 32;
  static constexpr int WTM = BM / WM;   // warp tile rows
  static constexpr int WTN = BN / WN;   // warp tile columns per operand
  static constexpr int MF = WTM / 16;   // m16 fragments per warp
  static constexpr int NF = WTN / 8;    // n8 fragments per warp and operand
  static constexpr int A_STAGE_BYTES = BM * BK * 2;
  static constexpr int B_ROWS = NB * BN;
  static constexpr int B_TILE_BYTES = B_ROWS * BK * 2;
  // Operand (0 .. NB - 1) of tile row r owned in iteration j of a loop whose iterations cover
  // THREADS / UNITS rows each (UNITS work units per row): a compile-time value after unrolling
  // when every iteration stays inside one operand, so the operand's pointers are selected
  // without a run-time select chain (fewer live registers next to the accumulators).
  template <int UNITS>
  __device__ __forceinline__ static int operand_of(int j, int r) {
    if constexpr (THREADS % UNITS == 0 && BN % (THREADS / UNITS) == 0) {
      return j * (THREADS / UNITS) / BN;
    } else {
      return r / BN;
    }
  }
  static_assert(sizeof(T) == 2, "the tensor-core pipeline takes 16-bit operands");
  static_assert(BM % (16 * WM) == 0 && BN % (16 * WN) == 0, "warp tile must be 16 x 16k");
  static_assert(NF % 2 == 0, "B fragments are loaded two n8 blocks at a time");
  static_assert((BM * GEMM_CHUNKS) % THREADS == 0, "A tile must split evenly over threads");
  static_assert((B_ROWS * GEMM_CHUNKS) % THREADS == 0, "B tile must split evenly over threads");
};

// a[b] for a run-time b < N without indexing a register array at run time (which would move
// the array to local memory): a select chain over compile-time indices.
template <typename P, int N>
__device__ __forceinline__ P pick(const P (&a)[N], int b) {
  P r = a[0];
#pragma unroll
  for (int i = 1; i < N; ++i) r = b == i ? a[i] : r;
  return r;
}

// Eight 16-bit values row[k .. k + 7] as one 16-byte chunk, zero at or past `limit` (scalar,
// predicated loads: the fallback for ragged K or unaligned rows). Built in registers, no local
// array, so it stays out of local memory.
template <typename T>
__device__ __forceinline__ uint4 load8_checked(const T* row, int k, int limit) {
  uint32_t p[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int ka = k + 2 * e;
    const float lo = ka < limit ? to_float(row[ka]) : 0.0f;
    const float hi = ka + 1 < limit ? to_float(row[ka + 1]) : 0.0f;
    p[e] = pack2<T>(lo, hi);  // exact: the values are already of T
  }
  return make_uint4(p[0], p[1], p[2], p[3]);
}

// ---------------------------------------------------------------------------------------------
// A loader: activations (M, K), row stride lda (elements)
// ---------------------------------------------------------------------------------------------

template <class Cfg>
struct ALoader {
  using T = typename Cfg::T;
  static constexpr int PER_THREAD = Cfg::BM * GEMM_CHUNKS / Cfg::THREADS;
  const T* x;
  long lda;
  int M, K, m0;
  bool vec;  // 16-byte cp.async path: K % 8 == 0, lda % 8 == 0, 16-byte aligned base

  __device__ ALoader(const T* x_, long lda_, int M_, int K_, int m0_)
      : x(x_), lda(lda_), M(M_), K(K_), m0(m0_) {
    vec = (K % 8 == 0) && (lda % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  }

  // Issue the copy of the A tile at k0 into `stage` (a swizzled BM x 64 tile).
  __device__ __forceinline__ void issue(unsigned char* stage, int k0, int tid) const {
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int id = tid + j * Cfg::THREADS;
      const int r = id / GEMM_CHUNKS;
      const int c = id % GEMM_CHUNKS;
      const int m = m0 + r;
      const int k = k0 + c * 8;
      unsigned char* dst = stage + swz(r, c);
      if (vec) {
        const bool ok = m < M && k < K;
        const T* src = x + (ok ? long(m) * lda + k : 0);
        cp_async16(smem_addr(dst), src, ok);
      } else {
        // Predicated scalar loads (ragged K or unaligned rows): visible after the barrier.
        *reinterpret_cast<uint4*>(dst) = load8_checked(x + long(min(m, M - 1)) * lda, k, m < M ? K : 0);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// B loaders: the weight tile of NB operands, BN rows each, rows n0 .. n0 + BN of each weight
// ---------------------------------------------------------------------------------------------

// 16-bit weights (N, K) row-major: land directly as the MMA operand tile.
template <class Cfg>
struct FloatB {
  using T = typename Cfg::T;
  static constexpr int LOOKAHEAD = 0;  // the stage is ready as soon as it lands
  static constexpr int STAGE_BYTES = Cfg::B_TILE_BYTES;
  static constexpr int EXTRA_BYTES = 0;
  static constexpr int PER_THREAD = Cfg::B_ROWS * GEMM_CHUNKS / Cfg::THREADS;
  const T* w[Cfg::NB];
  int N, K, n0;
  bool vec;

  // w_[b]: operand b's (N, K) weight (scales / biases are unused: the uniform constructor).
  __device__ FloatB(const void* const (&w_)[Cfg::NB], const T* const (&)[Cfg::NB],
                    const T* const (&)[Cfg::NB], int N_, int K_, int n0_)
      : N(N_), K(K_), n0(n0_) {
    vec = K % 8 == 0;
#pragma unroll
    for (int b = 0; b < Cfg::NB; ++b) {
      w[b] = static_cast<const T*>(w_[b]);
      vec = vec && ((reinterpret_cast<uintptr_t>(w_[b]) & 15) == 0);
    }
  }

  __device__ __forceinline__ void issue(unsigned char* stage, int k0, int tid) const {
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int id = tid + j * Cfg::THREADS;
      const int r = id / GEMM_CHUNKS;  // 0 .. NB * BN - 1
      const int c = id % GEMM_CHUNKS;
      const int b = Cfg::template operand_of<GEMM_CHUNKS>(j, r);
      const int n = n0 + r % Cfg::BN;
      const int k = k0 + c * 8;
      unsigned char* dst = stage + swz(r, c);
      if (vec) {
        const bool ok = n < N && k < K;
        const T* src = pick(w, b) + (ok ? long(n) * K + k : 0);
        cp_async16(smem_addr(dst), src, ok);
      } else {
        *reinterpret_cast<uint4*>(dst) = load8_checked(pick(w, b) + long(min(n, N - 1)) * K, k, n < N ? K : 0);
      }
    }
  }

  // Nothing to prepare: the landed stage is the operand.
  __device__ __forceinline__ void prepare(unsigned char*, unsigned char*, int, int, int) {}

  __device__ __forceinline__ unsigned char* operand(unsigned char* stage, unsigned char*, int) const {
    return stage;
  }
};

// MLX affine weights: w uint32 (N, K * BITS / 32), scales / biases (N, K / GS) of T.
// A stage lands packed (NB * BN rows of 2 * BITS words); prepare() dequantizes the NEXT stage
// into one of two 16-bit operand tiles while the MMAs of the current stage run, so every packed
// value is dequantized exactly once per block. Each thread owns 32-value segments (rows r,
// half h): 32 values of BITS bits are exactly BITS whole words of the row's bit stream.
// Values are T(s * q + b) rounded once (dequant.cuh: integer and paired-half tricks, one HFMA2
// per pair); a segment is decoded one shared-memory load group (16 bytes for 4- and 8-bit) at a
// time and each 8-value chunk is stored as soon as it is ready, so few words stay live next to
// the accumulators.
template <class Cfg, int BITS, int GS>
struct AffineB {
  using T = typename Cfg::T;
  static constexpr int LOOKAHEAD = 1;  // stage s + 1 is dequantized during stage s
  static constexpr int WPR = GEMM_BK * BITS / 32;             // packed words per row and stage
  static constexpr int STAGE_BYTES = Cfg::B_ROWS * WPR * 4;
  static constexpr int EXTRA_BYTES = Cfg::DQ_TILES * Cfg::B_TILE_BYTES;  // dequantized tiles
  static constexpr int SEGS = Cfg::B_ROWS * 2;                // 32-value segments per stage
  static constexpr int SEG_PER_THREAD = (SEGS + Cfg::THREADS - 1) / Cfg::THREADS;
  // Words per shared-memory load group and 8-value chunks decoded from one group.
  static constexpr int GW = BITS % 4 == 0 ? 4 : BITS;
  static constexpr int CPG = 4 * GW / BITS;
  static_assert(GS % 32 == 0, "a 32-value segment must sit in one group");
  static_assert(BITS >= 2 && BITS <= 8, "affine bits 2..8");

  const uint32_t* w[Cfg::NB];
  const T* scales[Cfg::NB];
  const T* biases[Cfg::NB];
  int N, K, n0, words_per_row, groups;
  bool vec;  // 16-byte copies of the packed rows
  // Scale (low half) and bias (high half) of each owned segment for the stage being prepared
  // next, as T bits in one register (splat to pairs at use: one register less per segment
  // next to the accumulators); 0 for segments past K, which then dequantize to +0 without a
  // branch.
  uint32_t sb_next[SEG_PER_THREAD];

  // w_[b]: operand b's packed uint32 (N, K * BITS / 32); s_, b_: its scales and biases.
  __device__ AffineB(const void* const (&w_)[Cfg::NB], const T* const (&s_)[Cfg::NB],
                     const T* const (&b_)[Cfg::NB], int N_, int K_, int n0_)
      : N(N_), K(K_), n0(n0_) {
    words_per_row = K * BITS / 32;
    groups = K / GS;
    vec = (WPR % 4 == 0) && (words_per_row % 4 == 0);
#pragma unroll
    for (int b = 0; b < Cfg::NB; ++b) {
      w[b] = static_cast<const uint32_t*>(w_[b]);
      scales[b] = s_[b];
      biases[b] = b_[b];
      vec = vec && ((reinterpret_cast<uintptr_t>(w_[b]) & 15) == 0);
    }
  }

  __device__ __forceinline__ void issue(unsigned char* stage, int k0, int tid) const {
    const int kw0 = k0 * BITS / 32;  // first word of the stage in each row
    if (vec) {
      constexpr int CPR = WPR / 4;   // 16-byte chunks per row
      constexpr int TOTAL = Cfg::B_ROWS * CPR;
#pragma unroll
      for (int j = 0; j < (TOTAL + Cfg::THREADS - 1) / Cfg::THREADS; ++j) {
        const int id = tid + j * Cfg::THREADS;
        if (TOTAL % Cfg::THREADS == 0 || id < TOTAL) {
          const int r = id / CPR;
          const int c = id % CPR;
          const int b = Cfg::template operand_of<CPR>(j, r);
          const int n = n0 + r % Cfg::BN;
          const int kw = kw0 + c * 4;
          const bool ok = n < N && kw < words_per_row;
          const uint32_t* src = pick(w, b) + (ok ? long(n) * words_per_row + kw : 0);
          cp_async16(smem_addr(stage + (r * WPR + c * 4) * 4), src, ok);
        }
      }
    } else {
      constexpr int TOTAL = Cfg::B_ROWS * WPR;
#pragma unroll
      for (int j = 0; j < (TOTAL + Cfg::THREADS - 1) / Cfg::THREADS; ++j) {
        const int id = tid + j * Cfg::THREADS;
        if (TOTAL % Cfg::THREADS == 0 || id < TOTAL) {
          const int r = id / WPR;
          const int c = id % WPR;
          const int b = Cfg::template operand_of<WPR>(j, r);
          const int n = n0 + r % Cfg::BN;
          const int kw = kw0 + c;
          const bool ok = n < N && kw < words_per_row;
          const uint32_t* src = pick(w, b) + (ok ? long(n) * words_per_row + kw : 0);
          cp_async4(smem_addr(stage + (r * WPR + c) * 4), src, ok);
        }
      }
    }
  }

  // Load the scale and bias of each owned segment of the stage at k0 (used by the next
  // prepare(); issued early so the global loads are in flight during the MMAs).
  __device__ __forceinline__ void fetch_scales(int k0, int tid) {
#pragma unroll
    for (int j = 0; j < SEG_PER_THREAD; ++j) {
      const int seg = tid + j * Cfg::THREADS;
      uint32_t sb = 0;
      if (SEGS % Cfg::THREADS == 0 || seg < SEGS) {
        const int r = seg / 2;
        const int b = Cfg::template operand_of<2>(j, r);
        const int n = min(n0 + r % Cfg::BN, N - 1);
        const int k = k0 + (seg % 2) * 32;
        if (k < K) {
          const long g = long(n) * groups + k / GS;
          sb = uint32_t(dq::bits16(pick(scales, b)[g])) |
               (uint32_t(dq::bits16(pick(biases, b)[g])) << 16);
        }
      }
      sb_next[j] = sb;
    }
  }

  // GW packed words at src (shared memory) with the widest loads the segment's alignment allows
  // (a segment starts at word BITS * seg: 16-byte aligned for BITS % 4 == 0, 8-byte for even
  // BITS; conflict-free either way).
  __device__ __forceinline__ static void load_words(const uint32_t* src, uint32_t (&words)[GW]) {
    if constexpr (GW % 4 == 0) {
      const uint4 q4 = *reinterpret_cast<const uint4*>(src);
      words[0] = q4.x;
      words[1] = q4.y;
      words[2] = q4.z;
      words[3] = q4.w;
    } else if constexpr (GW % 2 == 0) {
#pragma unroll
      for (int i = 0; i < GW; i += 2) {
        const uint2 q2 = *reinterpret_cast<const uint2*>(src + i);
        words[i] = q2.x;
        words[i + 1] = q2.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < GW; ++i) words[i] = src[i];
    }
  }

  // Dequantize the landed packed stage into the operand tile `dq` (swizzled, like FloatB's).
  __device__ __forceinline__ void prepare(unsigned char* packed, unsigned char* dq_tile, int,
                                          int tid, int) {
#pragma unroll
    for (int j = 0; j < SEG_PER_THREAD; ++j) {
      const int seg = tid + j * Cfg::THREADS;
      if (SEGS % Cfg::THREADS == 0 || seg < SEGS) {
        const int r = seg / 2;
        const int h = seg % 2;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(packed) + r * WPR + h * BITS;
        const uint32_t s2 = __byte_perm(sb_next[j], 0u, 0x1010);
        const uint32_t b2 = __byte_perm(sb_next[j], 0u, 0x3232);
#pragma unroll
        for (int g = 0; g < BITS / GW; ++g) {  // one load group at a time
          uint32_t words[GW];
          load_words(src + g * GW, words);
#pragma unroll
          for (int c = 0; c < CPG; ++c) {  // 8-value chunks of the group, stored at once
            uint32_t out[4];
            dq::chunk8<T, BITS>(words, c, s2, b2, out);
            *reinterpret_cast<uint4*>(dq_tile + swz(r, h * 4 + g * CPG + c)) =
                make_uint4(out[0], out[1], out[2], out[3]);
          }
        }
      }
    }
  }

  __device__ __forceinline__ unsigned char* operand(unsigned char*, unsigned char* dq, int s) const {
    return dq + (s % Cfg::DQ_TILES) * Cfg::B_TILE_BYTES;
  }
};

// The weight loader of a format: BITS == 0 is a 16-bit float weight, else MLX affine BITS/GS.
// Every GEMM body takes each weight as a (w, scales, biases) triple (placeholders for float
// weights), so one body serves every format.
template <class Cfg, int BITS, int GS>
struct WeightLoader {
  using type = AffineB<Cfg, BITS, GS>;
};
template <class Cfg, int GS>
struct WeightLoader<Cfg, 0, GS> {
  using type = FloatB<Cfg>;
};

// ---------------------------------------------------------------------------------------------
// Warp tile: NB operands x MF x NF m16n8 accumulators
// ---------------------------------------------------------------------------------------------

template <class Cfg>
struct WarpTile {
  using T = typename Cfg::T;
  // mma.sync is synchronous: issue() computes the stage, retire() has nothing to wait for.
  static constexpr bool ASYNC = false;
  // k16 steps per unrolled iteration of mma_stage: all four when the accumulators leave room.
  static constexpr int KK_UNROLL = Cfg::NB * Cfg::MF * Cfg::NF * 4 > 64 ? 1 : 4;
  float acc[Cfg::NB][Cfg::MF][Cfg::NF][4];
  int wm, wn, lane;

  __device__ WarpTile(int warp, int lane_) : wm(warp / Cfg::WN), wn(warp % Cfg::WN), lane(lane_) {
#pragma unroll
    for (int b = 0; b < Cfg::NB; ++b)
#pragma unroll
      for (int i = 0; i < Cfg::MF; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::NF; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[b][i][j][e] = 0.0f;
  }

  // acc += A (stage) * B (operand tile)^T over the 64 k of one stage.
  __device__ __forceinline__ void mma_stage(const unsigned char* As, const unsigned char* Bs) {
    const uint32_t a_base = smem_addr(As);
    const uint32_t b_base = smem_addr(Bs);
    // Unrolled only as far as the registers allow: with a 64 x 64 warp tile (128 accumulators)
    // ptxas would otherwise hoist all four k16 steps' fragments and spill.
#pragma unroll KK_UNROLL
    for (int kk = 0; kk < GEMM_CHUNKS; kk += 2) {  // k16 steps: chunks kk, kk + 1
      uint32_t a[Cfg::MF][4];
#pragma unroll
      for (int i = 0; i < Cfg::MF; ++i) {
        const int r = wm * Cfg::WTM + i * 16 + (lane % 16);
        ldmatrix_x4(a[i], a_base + swz(r, kk + lane / 16));
      }
#pragma unroll
      for (int b = 0; b < Cfg::NB; ++b) {
        uint32_t bf[Cfg::NF][2];
#pragma unroll
        for (int j = 0; j < Cfg::NF; j += 2) {
          const int r = b * Cfg::BN + wn * Cfg::WTN + j * 8 + (lane / 16) * 8 + (lane % 8);
          uint32_t t4[4];
          ldmatrix_x4(t4, b_base + swz(r, kk + (lane / 8) % 2));
          bf[j][0] = t4[0];
          bf[j][1] = t4[1];
          bf[j + 1][0] = t4[2];
          bf[j + 1][1] = t4[3];
        }
#pragma unroll
        for (int i = 0; i < Cfg::MF; ++i)
#pragma unroll
          for (int j = 0; j < Cfg::NF; ++j) mma_16816<T>(acc[b][i][j], a[i], bf[j]);
      }
    }
  }

  __device__ __forceinline__ void issue(const unsigned char* As, const unsigned char* Bs) {
    mma_stage(As, Bs);
  }

  __device__ __forceinline__ void retire() {}
  __device__ __forceinline__ void drain() {}

  // Epilogue walk: op(acc_pair, b, row, col) for each pair of adjacent output columns this lane
  // holds, rows/cols block-relative (operand b's column col).
  template <class Op>
  __device__ __forceinline__ void for_each(Op& op) const {
    const int g = lane / 4;
    const int t = lane % 4;
#pragma unroll
    for (int i = 0; i < Cfg::MF; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::NF; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wm * Cfg::WTM + i * 16 + g + h * 8;
          const int col = wn * Cfg::WTN + j * 8 + 2 * t;
          float v[Cfg::NB][2];
#pragma unroll
          for (int b = 0; b < Cfg::NB; ++b) {
            v[b][0] = acc[b][i][j][2 * h];
            v[b][1] = acc[b][i][j][2 * h + 1];
          }
          op(v, row, col);
        }
  }
};

// ---------------------------------------------------------------------------------------------
// The K loop
// ---------------------------------------------------------------------------------------------

// Shared memory of a configuration with weight loader BL, in bytes (the ops size
// mx.fast.cuda_kernel's dynamic shared memory with the same formula).
// Regions start 1024-byte aligned (wgmma's 128-byte-swizzle tiles need it), and the dynamic
// shared memory is over-allocated by ALIGN so its start can be aligned at run time.
template <class Cfg, class BL>
struct GemmSmem {  // EXTRA_BYTES already counts Cfg::DQ_TILES dequantized tiles
  static constexpr int ALIGN = 1024;
  static constexpr int round(int n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }
  static constexpr int A_BYTES = round(Cfg::STAGES * Cfg::A_STAGE_BYTES);
  static constexpr int B_BYTES = round(Cfg::STAGES * BL::STAGE_BYTES);
  static constexpr int TOTAL = A_BYTES + B_BYTES + BL::EXTRA_BYTES + ALIGN;
};

// The first 1024-byte-aligned address of the dynamic shared memory.
__device__ __forceinline__ unsigned char* align_smem(unsigned char* smem) {
  const uint32_t a = smem_addr(smem);
  return smem + ((1024u - (a & 1023u)) & 1023u);
}

// Runs the K loop for one block tile over stages [first, last) of 64 k each (default: all of
// K; split-K blocks take a part). smem: dynamic shared memory laid out as [A stages][B stages]
// [loader extra]. The s-th stage of the range lands in ring slot s % STAGES; the weight
// loader's operand for it is ready LOOKAHEAD stages ahead. An empty range leaves the
// accumulators at 0.
// Barriers: one per K step (it orders the ring slot reuse, the dequantized-tile reuse and the
// visibility of cp.async data and scalar stores).
template <class Cfg, class AL, class BL, class Mma>
__device__ __forceinline__ void gemm_mainloop(unsigned char* smem, const AL& al, BL& bl,
                                              Mma& mma, int K, int tid, int first = 0,
                                              int last = -1) {
  constexpr int S = Cfg::STAGES;
  constexpr int LA = BL::LOOKAHEAD;
  constexpr int D = Cfg::DEPTH;
  constexpr int P = S - 1 - D;  // prefetch distance: stage s + P is issued in iteration s
  static_assert(P - 1 - LA >= 0, "need at least 2 + lookahead + depth stages");
  using Smem = GemmSmem<Cfg, BL>;
  unsigned char* a_ring = smem;
  unsigned char* b_ring = smem + Smem::A_BYTES;
  unsigned char* extra = smem + Smem::A_BYTES + Smem::B_BYTES;
  if (last < 0) last = (K + Cfg::BK - 1) / Cfg::BK;
  const int steps = last - first;
  const int k_first = first * Cfg::BK;

  // Prologue: stages 0 .. P - 1 in flight (one commit group each, empty past the end).
#pragma unroll
  for (int s = 0; s < P; ++s) {
    if (s < steps) {
      al.issue(a_ring + s * Cfg::A_STAGE_BYTES, k_first + s * Cfg::BK, tid);
      bl.issue(b_ring + s * BL::STAGE_BYTES, k_first + s * Cfg::BK, tid);
    }
    cp_async_commit();
  }
  if constexpr (LA == 1) {
    // Stage 0 must be dequantized before the loop: wait for it alone.
    bl.fetch_scales(k_first, tid);
    cp_async_wait<P - 1>();
    __syncthreads();
    bl.prepare(b_ring, extra, k_first, tid, 0);
    if (steps > 1) bl.fetch_scales(k_first + Cfg::BK, tid);
  }

  for (int s = 0; s < steps; ++s) {
    // Stages <= s + LA have landed (for this thread); the barrier publishes them to all. Every
    // read of ring slot (s + P) % S (stage s - 1 - D) and of the operand tile prepared below
    // (stage s + 1 - DQ_TILES) was retired by its thread before this barrier. The proxy fence
    // makes this thread's generic-proxy writes (cp.async, dequantized tiles) visible to wgmma.
    cp_async_wait<P - 1 - LA>();
    if constexpr (Mma::ASYNC) fence_proxy_async();
    __syncthreads();
    const unsigned char* a_stage = a_ring + (s % S) * Cfg::A_STAGE_BYTES;
    const unsigned char* b_stage = bl.operand(b_ring + (s % S) * BL::STAGE_BYTES, extra, s);
    if constexpr (Mma::ASYNC) mma.issue(a_stage, b_stage);  // runs while we copy below
    const int nxt = s + P;
    if (nxt < steps) {
      al.issue(a_ring + (nxt % S) * Cfg::A_STAGE_BYTES, k_first + nxt * Cfg::BK, tid);
      bl.issue(b_ring + (nxt % S) * BL::STAGE_BYTES, k_first + nxt * Cfg::BK, tid);
    }
    cp_async_commit();
    if constexpr (LA == 1) {
      if (s + 1 < steps) {
        bl.prepare(b_ring + ((s + 1) % S) * BL::STAGE_BYTES,
                   extra + ((s + 1) % Cfg::DQ_TILES) * Cfg::B_TILE_BYTES,
                   k_first + (s + 1) * Cfg::BK, tid, s + 1);
        if (s + 2 < steps) bl.fetch_scales(k_first + (s + 2) * Cfg::BK, tid);
      }
    }
    if constexpr (Mma::ASYNC) {
      mma.retire();  // all but the newest DEPTH groups
    } else {
      mma.issue(a_stage, b_stage);
    }
  }
  mma.drain();
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------------------------
// Block order
// ---------------------------------------------------------------------------------------------

// Block pid of a 1-D grid -> (m tile, n tile), grouped GROUP_M m-tiles at a time so the blocks
// in flight share a band of weight rows and a band of activation rows in L2 (the "grouped"
// launch order of Triton's matmul tutorial).
template <int GROUP_M>
__device__ __forceinline__ void grouped_tile(int pid, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int in_group = GROUP_M * tiles_n;
  const int group = pid / in_group;
  const int first_m = group * GROUP_M;
  const int size_m = min(tiles_m - first_m, GROUP_M);
  const int local = pid % in_group;
  tm = first_m + local % size_m;
  tn = local / size_m;
}

// ---------------------------------------------------------------------------------------------
// Epilogue helpers
// ---------------------------------------------------------------------------------------------

// An epilogue is an element op and a destination, as MLX steel's transforms: WarpTile::for_each
// hands Epilogue each pair of adjacent output columns (col, col + 1) of one row; Epilogue checks
// the bounds once, the op turns the accumulators into the two output values (reading bias /
// residual / up pairs through load_pair), and the destination stores them.

// T values p[0], p[1] as floats (p[1] only when `two`, else 0): one 32-bit load when both are
// in bounds and the pair is 4-byte aligned.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* p, bool two) {
  if (two && (reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    return unpack2<T>(*reinterpret_cast<const uint32_t*>(p));
  }
  return make_float2(to_float(p[0]), two ? to_float(p[1]) : 0.0f);
}

// SiLU(g) = g / (1 + exp(-g)) with exp of -|g| only (no overflow for any finite g), as the MSL
// brick computes it (metal_src/swiglu.h).
__device__ __forceinline__ float silu(float g) {
  const float e = expf(-fabsf(g));
  const float d = 1.0f + e;
  return g >= 0.0f ? g / d : (g * e) / d;
}

// GELU, tanh approximation (mlx.nn.gelu_approx), as the MSL brick computes it
// (metal_src/swiglu.h): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), the tanh argument
// clamped to [-10, 10] so an overflowing g^3 never reaches tanh.
__device__ __forceinline__ float gelu_tanh(float g) {
  const float u = 0.7978845608028654f * g * (1.0f + 0.044715f * g * g);
  return 0.5f * g * (1.0f + tanhf(fminf(fmaxf(u, -10.0f), 10.0f)));
}

// The SwiGLU kernels' ACT template parameter: the gate's activation (metal_src/swiglu.h).
constexpr int ACT_SILU = 0;
constexpr int ACT_GELU_TANH = 1;

template <int ACT>
__device__ __forceinline__ float activation(float g) {
  static_assert(ACT == ACT_SILU || ACT == ACT_GELU_TANH, "ACT must be 0 (SiLU) or 1 (GELU-tanh)");
  if constexpr (ACT == ACT_GELU_TANH) {
    return gelu_tanh(g);
  } else {
    return silu(g);
  }
}

// ---- element ops: (accumulators of NB operands, row, col, two) -> the two output values ----

// acc (+ bias[col]) (+ residual[row, col]), summed in float, rounded once on the store; residual
// (M, ld) row-major.
template <typename T, bool HAS_BIAS, bool HAS_RESIDUAL>
struct AddBiasResidual {
  const T* bias;
  const T* residual;
  long ld;

  __device__ __forceinline__ float2 operator()(const float (&v)[1][2], int row, int col,
                                               bool two) const {
    float2 o = make_float2(v[0][0], v[0][1]);
    if constexpr (HAS_BIAS) {
      const float2 b = load_pair(bias + col, two);
      o.x += b.x;
      o.y += b.y;
    }
    if constexpr (HAS_RESIDUAL) {
      const float2 r = load_pair(residual + long(row) * ld + col, two);
      o.x += r.x;
      o.y += r.y;
    }
    return o;
  }
};

// act(acc + bias[col]) * up[row, col] (the split SwiGLU's gate GEMM; up was computed by the up
// GEMM and rounded to T, as the MSL split variant and the stock MLP do).
template <typename T, bool HAS_BIAS, int ACT>
struct GateTimesUp {
  const T* bias;
  const T* up;
  long ld;

  __device__ __forceinline__ float2 operator()(const float (&v)[1][2], int row, int col,
                                               bool two) const {
    float g0 = v[0][0];
    float g1 = v[0][1];
    if constexpr (HAS_BIAS) {
      const float2 b = load_pair(bias + col, two);
      g0 += b.x;
      g1 += b.y;
    }
    const float2 u = load_pair(up + long(row) * ld + col, two);
    return make_float2(activation<ACT>(g0) * u.x, activation<ACT>(g1) * u.y);
  }
};

// act(gate + b_gate) * (up + b_up) from the fused block's two operands (b = 0 gate, b = 1 up),
// all in float, one rounding.
template <typename T, bool HAS_BIAS_GATE, bool HAS_BIAS_UP, int ACT>
struct GateUp {
  const T* b_gate;
  const T* b_up;

  __device__ __forceinline__ float2 operator()(const float (&v)[2][2], int, int col,
                                               bool two) const {
    float g0 = v[0][0], g1 = v[0][1], u0 = v[1][0], u1 = v[1][1];
    if constexpr (HAS_BIAS_GATE) {
      const float2 b = load_pair(b_gate + col, two);
      g0 += b.x;
      g1 += b.y;
    }
    if constexpr (HAS_BIAS_UP) {
      const float2 b = load_pair(b_up + col, two);
      u0 += b.x;
      u1 += b.y;
    }
    return make_float2(activation<ACT>(g0) * u0, activation<ACT>(g1) * u1);
  }
};

// ---- destinations ----

// (rows, ld) row-major: one 32-bit (float32: 64-bit) store when both columns are in bounds and
// aligned.
template <typename T>
struct RowMajor {
  T* out;
  long ld;

  __device__ __forceinline__ void store(int row, int col, bool two, float2 o) const {
    T* p = out + long(row) * ld + col;
    if constexpr (sizeof(T) == 4) {  // float32 (split-K partial sums)
      if (two && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
        *reinterpret_cast<float2*>(p) = o;
        return;
      }
    } else if (two && (reinterpret_cast<uintptr_t>(p) & 3) == 0) {
      *reinterpret_cast<uint32_t*>(p) = pack2<T>(o.x, o.y);
      return;
    }
    p[0] = from_float<T>(o.x);
    if (two) p[1] = from_float<T>(o.y);
  }
};

// The RMSNorm + QKV layout: column n = h * D + d of row m = b * L + l goes to
// out[((b * H + h) * L + l) * D + d], (B, H, L, D).
template <typename T>
struct HeadLayout {
  T* out;
  int L, H, D;

  __device__ __forceinline__ void store(int row, int col, bool two, float2 o) const {
    const int b = row / L;
    const int l = row - b * L;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (e == 1 && !two) break;
      const int n = col + e;
      const int h = n / D;
      const int d = n - h * D;
      out[((long(b) * H + h) * L + l) * D + d] = from_float<T>(e == 0 ? o.x : o.y);
    }
  }
};

// The epilogue WarpTile::for_each calls: block-relative (r, c) -> bounds check, op, store.
template <class Op, class Dst>
struct Epilogue {
  Op op;
  Dst dst;
  int M, N, m0, n0;

  template <int NB>
  __device__ __forceinline__ void operator()(const float (&v)[NB][2], int r, int c) const {
    const int row = m0 + r;
    const int col = n0 + c;
    if (row >= M || col >= N) return;
    const bool two = col + 1 < N;
    dst.store(row, col, two, op(v, row, col, two));
  }
};

template <class Op, class Dst>
__device__ __forceinline__ Epilogue<Op, Dst> make_epilogue(Op op, Dst dst, int M, int N, int m0,
                                                         int n0) {
  return Epilogue<Op, Dst>{op, dst, M, N, m0, n0};
}

// One block tile: the K loop on (x, the weight loader), then the epilogue.
// x: (M, K) row-major; m0: first row of the tile.
// Mma: the MMA policy, WarpTile<Cfg> (mma.sync, sm_80+) or WgmmaTile<Cfg> (sm_90a).
template <class Cfg, class Mma, class BL, class Epi>
__device__ __forceinline__ void gemm_block(unsigned char* smem, const typename Cfg::T* x, int M,
                                           int K, int m0, BL& bl, Epi& epi, int first = 0,
                                           int last = -1) {
  const int tid = threadIdx.x;
  ALoader<Cfg> al(x, K, M, K, m0);
  Mma mma(tid / 32, tid % 32);
  gemm_mainloop<Cfg>(align_smem(smem), al, bl, mma, K, tid, first, last);
  mma.for_each(epi);
}

// Split-K: the K stages [first, last) of split `split` of `splits` (contiguous, as even as
// whole 64-wide stages allow; a split past the end gets an empty range).
__device__ __forceinline__ void split_range(int K, int split, int splits, int& first, int& last) {
  const int steps = (K + GEMM_BK - 1) / GEMM_BK;
  const int per = (steps + splits - 1) / splits;
  first = min(steps, split * per);
  last = min(steps, first + per);
}

}  // namespace bricks

#endif  // MLX_BRICKS_GEMM_CUH
