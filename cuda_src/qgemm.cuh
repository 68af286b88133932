// qgemm.cuh -- mixed-input GEMM: MLX affine weights dequantized in registers, straight into the
// tensor-core A fragments (Marlin / Machete style), on a warp-specialized cp.async pipeline.
// Needs mma.cuh, dequant.cuh and gemm.cuh before it (qgemm_wgmma.cuh after it for sm_90a).
//
// The GEMM runs transposed: Y^T (N x M) = W (N x K) X^T. The quantized weight is the A operand
// (the one wgmma can take from registers), the activations the B operand read from shared
// memory, so no dequantized weight tile is ever written anywhere.
//
//   block   384 threads: warpgroups 0-1 consume, warpgroup 2 produces (kQThreads). The kernels
//           carry __launch_bounds__(384, 1): 168 registers per thread (an SM sub-partition holds
//           3 of the 12 warps); on sm_90a the producers drop to kQProducerRegs (56) with
//           setmaxnreg and the consumers rise to kQConsumerRegs (224): the 128 accumulators of
//           a 64 x 256 wgmma tile need it (128 x 56 + 256 x 224 = 64,512 of 65,536 registers).
//   stage   64 k: the activation tile X (BM tokens x 128 bytes, 16-byte chunk c of row r at
//           chunk c ^ (r % 8): conflict-free for ldmatrix and wgmma's 128-byte swizzle) and the
//           packed weight tile W (BN rows x 8 BITS bytes, chunks XOR-swizzled per row so that a
//           warp's fragment loads hit 32 distinct banks), in a STAGES-deep ring.
//   produce the producer threads wait for slot s % STAGES to be empty (mbarrier), issue the
//           stage's cp.async
//           copies (zero-filled past M, N, K) and arm the slot's full barrier with
//           cp.async.mbarrier.arrive.noinc: no thread ever waits on its own copies.
//   consume each consumer thread waits for the slot to be full, builds its A fragments with a
//           few integer / paired-half operations per pair of weights (QFrag), runs the MMAs
//           (QMmaConsumer: mma.sync m16n8k16, sm_80+; QWgmmaConsumer: wgmma RS, sm_90a) and
//           arrives on the slot's empty barrier once its MMAs no longer read it.
//   output  the accumulators go through shared memory once (transposed back to token rows),
//           then each consumer thread applies the epilogue op to 8 adjacent columns and
//           stores 16 bytes (the ops: qgemm_ops.cuh).
//
// Weight rows of the tile: row r is operand r / OUT_N (NB = 2: gate rows, then up rows), output
// column n0 + r % OUT_N. Sources: PTX ISA 8.x (mbarrier, cp.async.mbarrier.arrive, wgmma);
// CUTLASS 3's warp-specialized cp.async mainloop and mixed-input RS mainloop, Marlin's
// in-register dequantization (ideas; written here for MLX's bit order without repacking).
#ifndef MLX_BRICKS_QGEMM_CUH
#define MLX_BRICKS_QGEMM_CUH

namespace bricks {

constexpr int kQThreads = 384;    // 2 consumer warpgroups + 1 producer warpgroup
constexpr int kQConsumers = 256;  // consumer threads (empty-barrier count, named barrier 1)
constexpr int kQProducers = 128;  // producer threads (full-barrier count)
constexpr int kQProducerRegs = 56, kQConsumerRegs = 224;  // sm_90a setmaxnreg budgets

// T, BM tokens, BN weight rows (all NB operands), STAGES, affine BITS (4 or 8) and GS.
template <typename T_, int BM_, int BN_, int NB_, int STAGES_, int BITS_, int GS_>
struct QConfig {
  using T = T_;
  static constexpr int BM = BM_, BN = BN_, NB = NB_, STAGES = STAGES_, BITS = BITS_, GS = GS_;
  static constexpr int BK = 64;
  static constexpr int OUT_N = BN / NB;           // output columns of a block
  static constexpr int GPS = GS == 32 ? 2 : 1;    // groups per 64-k stage
  static constexpr int X_SLOT = BM * 128;
  static constexpr int ROWB = BK * BITS / 8;      // packed bytes per weight row and stage
  static constexpr int CPR = ROWB / 16;           // 16-byte chunks per weight row
  static constexpr int RPB = 128 / ROWB;          // weight rows per 128-byte bank line
  static constexpr int W_SLOT = BN * ROWB;
  static constexpr int W_OFF = STAGES * X_SLOT;   // X slots first: 1024-byte aligned
  static constexpr int RING = W_OFF + STAGES * W_SLOT;
  static constexpr int PITCH = OUT_N + 4;         // staged floats per token row and operand
  static constexpr int OUT_BYTES = NB * BM * PITCH * 4;  // the output tile reuses the ring
  // mbarriers (full, then empty) after both: never overwritten by the output tile.
  static constexpr int BAR_OFF = RING > OUT_BYTES ? RING : OUT_BYTES;
  static constexpr int ROWS_OFF = BAR_OFF + 2 * STAGES * 8;  // the producer's row table
  static constexpr int SMEM = ROWS_OFF + BM * 8 + 1024;
  static_assert(sizeof(T) == 2, "16-bit activations");
  static_assert(BITS == 4 || BITS == 8, "the register path takes 4- and 8-bit weights");
  static_assert(GS % 32 == 0 && GS >= 32 && GS <= 128, "group size 32, 64 or 128");
  static_assert(BM % 16 == 0 && BM <= 256, "tile shape");
  static_assert(OUT_N % 32 == 0, "staged rows: 32 columns per bank round");
};

// Byte offset of 16-byte chunk c of packed weight row r (XOR swizzle per 128-byte line).
template <class C>
__device__ __forceinline__ int wchunk(int r, int c) {
  return r * C::ROWB + ((c ^ ((r / C::RPB) % C::CPR)) << 4);
}

// ---------------------------------------------------------------------------------------------
// Producer: one warpgroup, X and W of a stage per call
// ---------------------------------------------------------------------------------------------

// Which activation row each tile row reads and which output row it writes (rows are tile-
// relative r = 0 .. BM - 1 from m0). GATHER: row r is token order[m0 + r] / top_k of x (the
// MoE gate / up); SCATTER: it is written to output row order[m0 + r] (the MoE down). Rows at or
// past `end` are dead (zero in, never written).
template <typename T, bool GATHER, bool SCATTER>
struct QRows {
  const T* x;
  const uint32_t* order;
  int top_k, end, K, m0;

  // Element offset of row r in x, or -1.
  __device__ __forceinline__ long src(int r) const {
    const int m = m0 + r;
    if (m >= end) return -1;
    return long(GATHER ? int(order[m] / unsigned(top_k)) : m) * K;
  }
  // Output row of tile row r, or -1.
  __device__ __forceinline__ long dst(int r) const {
    const int m = m0 + r;
    if (m >= end) return -1;
    return SCATTER ? long(order[m]) : long(m);
  }
};

template <class C>
struct QProducer {
  using T = typename C::T;
  static constexpr int RS = kQProducers / 8;      // X rows per pass (8 chunks per row)
  static constexpr int WCH = C::BN * C::CPR;      // weight chunks of a stage
  static_assert(WCH % kQProducers == 0 && C::BM % RS == 0, "chunks split evenly");
  const T* x;
  const uint32_t* w[C::NB];
  const long* rows;  // shared row table: src offsets of this thread's rows (own entries only)
  int K, wpr;        // wpr: packed words per weight row
  int x_dst;         // shared offset of its first X chunk (every row of it: same chunk position)
  int c8, p, n_lim;
  bool x_vec, w_vec; // 16-byte copies possible (else scalar / 4-byte paths)

  // Fills this thread's entries of the row table (rows p / 8 + RS j), read back only by it.
  template <class Rows>
  __device__ QProducer(const Rows& map, const void* const (&w_)[C::NB], int N, int n0,
                       long* table, int p_)
      : x(map.x), rows(table), K(map.K), p(p_) {
    wpr = K * C::BITS / 32;
    const int r0 = p / 8, c = p % 8;
    c8 = 8 * c;
    x_dst = swz(r0, c);  // (r0 + RS j) % 8 == r0 % 8
    n_lim = N - n0;
    x_vec = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && K % 8 == 0;
    w_vec = wpr % 4 == 0;
#pragma unroll
    for (int b = 0; b < C::NB; ++b) {
      w[b] = static_cast<const uint32_t*>(w_[b]) + long(n0) * wpr;
      w_vec = w_vec && (reinterpret_cast<uintptr_t>(w_[b]) & 15) == 0;
    }
    if (c == 0) {
#pragma unroll 1
      for (int j = 0; j < C::BM / RS; ++j) table[r0 + RS * j] = map.src(r0 + RS * j);
    }
    __syncwarp();  // lane 8 i wrote the rows lanes 8 i .. 8 i + 7 read
  }

  // Copy stage k0 into slot (xs, ws) and arm `full` (one arrival per producer thread).
  __device__ __forceinline__ void stage(unsigned char* xs, unsigned char* ws, uint64_t* full,
                                        int k0) const {
    // W: thread p's chunk column c is fixed, its rows are p / CPR + (128 / CPR) j.
    constexpr int WR = kQProducers / C::CPR;
    const int c = p % C::CPR;
    const int kw = k0 * C::BITS / 32 + 4 * c;
    const bool kw_ok = kw < wpr;
#pragma unroll 1
    for (int j = 0; j < WCH / kQProducers; ++j) {
      const int r = p / C::CPR + WR * j;
      const int n = r % C::OUT_N;  // row of operand r / OUT_N, relative to n0
      const bool ok = kw_ok && n < n_lim;
      const uint32_t* src = pick(w, r / C::OUT_N) + (ok ? long(n) * wpr + kw : 0);
      const uint32_t dst = smem_addr(ws + wchunk<C>(r, c));
      if (w_vec) {
        cp_async16(dst, src, ok);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) cp_async4(dst + 4 * e, src + (ok ? e : 0), ok && kw + e < wpr);
      }
    }
    // X: thread p's chunk column is fixed, its rows are p / 8 + RS j.
    const int k = k0 + c8;
    const bool k_ok = k < K;
    const int r0 = p / 8;
    if (x_vec) {
      uint32_t dst = smem_addr(xs + x_dst);
#pragma unroll 1
      for (int j = 0; j < C::BM / RS; ++j) {
        const long off = rows[r0 + RS * j];
        const bool ok = k_ok && off >= 0;
        cp_async16(dst, x + (ok ? off + k : 0), ok);
        dst += RS * 128;
      }
      cp_async_mbar_arrive(full);
    } else {
      // Unaligned x: plain loads and stores; the weight copies are waited for here, so one
      // ordinary (release) arrival publishes both.
#pragma unroll 1
      for (int j = 0; j < C::BM / RS; ++j) {
        const long off = rows[r0 + RS * j];
        *reinterpret_cast<uint4*>(xs + x_dst + j * RS * 128) =
            load8_checked(x + (off >= 0 ? off : 0), k, off >= 0 ? K : 0);
      }
      cp_async_commit();
      cp_async_wait<0>();
      mbar_arrive(full);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Weights to A fragments
// ---------------------------------------------------------------------------------------------

// Scale (low 16 bits) and bias (high) of the weight rows a thread's fragments cover: rows
// row16(i) + g and + 8 of each of its MI 16-row blocks, GPS groups per stage; 0 past N or K,
// so those weights dequantize to +0 without a branch.
template <class C, int MI>
struct QScales {
  using T = typename C::T;
  const T* s;
  const T* b;
  int off[MI][2];  // row * groups, -1 past N
  int groups;

  template <class Rows>
  __device__ QScales(const T* const (&s_)[C::NB], const T* const (&b_)[C::NB], int N, int K,
                     int n0, int g, const Rows& rows) {
    groups = K / C::GS;
    const int op = rows(0) / C::OUT_N;  // one operand per consumer warp (static_asserts)
    s = pick(s_, op);
    b = pick(b_, op);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n0 + (rows(i) + g + 8 * h) % C::OUT_N;
        off[i][h] = n < N ? n * groups : -1;
      }
  }

  __device__ __forceinline__ void fetch(int step, uint32_t (&sb)[MI][2][C::GPS]) const {
#pragma unroll
    for (int q = 0; q < C::GPS; ++q) {
      const int grp = C::GPS == 2 ? 2 * step + q : step * C::BK / C::GS;
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t v = 0;
          if (off[i][h] >= 0 && grp < groups) {
            v = uint32_t(dq::bits16(s[off[i][h] + grp])) |
                (uint32_t(dq::bits16(b[off[i][h] + grp])) << 16);
          }
          sb[i][h][q] = v;
        }
    }
  }
};

// One lane's A fragments (m16n8k16 / wgmma RS layout: a0 (g, 2t..2t+1), a1 (g + 8, 2t..),
// a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..)) dequantized from the packed stage. 4-bit: the
// fragment's k pair (2t, 2t + 1) of a k8 run is byte t of the run's word; 8-bit: bytes
// 2 (t % 2), + 1 of word t / 2 of the run. The byte is moved by one PRMT with a per-lane
// selector, turned into 2^MB + q in both halves of a pair (LOP3 with the exponent magic) and
// made q exactly (HSUB2; fp16 4-bit takes the high nibble in place and rescales with one
// HFMA2); 8-bit bf16 goes through the float magic 2^23 (q > 127 does not fit bf16's mantissa).
// Then one HFMA2 (s, q, b): T(s q + b) rounded once, as dequant.cuh and MLX's sm_90 dequantize.
template <class C>
struct QFrag {
  using T = typename C::T;
  static constexpr bool BF16 = dq::Half16<T>::MB == 7;
  uint32_t sel;  // PRMT selector of this lane's bytes
  int g, t;

  __device__ explicit QFrag(int lane) : g(lane / 4), t(lane % 4) {
    if constexpr (C::BITS == 4) {
      sel = BF16 ? uint32_t(t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12)) : uint32_t(t * 0x1111);
    } else {
      const uint32_t h = 2 * (t % 2);
      sel = BF16 ? h : uint32_t(h | (4u << 4) | ((h + 1) << 8) | (4u << 12));
    }
  }

  // Two 4-bit weights (byte t of w) as an exact-integer pair.
  __device__ __forceinline__ uint32_t nibbles(uint32_t w) const {
    if constexpr (BF16) {
      const uint32_t x = __byte_perm(w, w >> 4, sel);
      constexpr uint32_t MAGIC = dq::splat(dq::pow2_bits<T>(7));
      return h2_sub<T>(lop3_and_or(x, 0x000F000Fu, MAGIC), MAGIC);
    } else {
      const uint32_t x = __byte_perm(w, 0u, sel);  // byte t in all four bytes
      constexpr uint32_t MAGIC = dq::splat(dq::pow2_bits<T>(10));
      // (1024 + q0, 1024 + 16 q1) -> (q0, q1): scale (1, 1/16), add (-1024, -64)
      constexpr uint32_t S = dq::pow2_bits<T>(0) | (dq::pow2_bits<T>(-4) << 16);
      constexpr uint32_t B = dq::pow2_bits<T>(10, true) | (dq::pow2_bits<T>(6, true) << 16);
      return h2_fma<T>(lop3_and_or(x, 0x00F0000Fu, MAGIC), S, B);
    }
  }

  // Two 8-bit weights (bytes 2 (t % 2), + 1 of w) as an exact-integer pair.
  __device__ __forceinline__ uint32_t bytes(uint32_t w) const {
    if constexpr (BF16) {
      const float magic = 8388608.0f;  // 0x4B0000qq is 2^23 + q
      const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, sel | 0x7440u)) - magic;
      const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, (sel + 1) | 0x7440u)) - magic;
      return pack2<T>(lo, hi);  // exact: integers up to 255
    } else {
      return h2_sub<T>(__byte_perm(w, 0x64646464u, sel), dq::splat(dq::pow2_bits<T>(10)));
    }
  }

  // A fragment of rows row16 + g, + 8 for k16 step kb of the stage at ws; sb0, sb1: their
  // (scale | bias << 16) bits for the step's group.
  __device__ __forceinline__ void operator()(const unsigned char* ws, int row16, int kb,
                                             uint32_t sb0, uint32_t sb1, uint32_t (&a)[4]) const {
    const int r0 = row16 + g, r1 = r0 + 8;
    uint32_t q[4];
    if constexpr (C::BITS == 4) {  // words 2 kb, 2 kb + 1: one 8-byte load per row
      const int in = (kb % 2) * 8;
      const uint2 u0 = *reinterpret_cast<const uint2*>(ws + wchunk<C>(r0, kb / 2) + in);
      const uint2 u1 = *reinterpret_cast<const uint2*>(ws + wchunk<C>(r1, kb / 2) + in);
      q[0] = nibbles(u0.x);
      q[1] = nibbles(u1.x);
      q[2] = nibbles(u0.y);
      q[3] = nibbles(u1.y);
    } else {  // words 4 kb + t / 2 and 4 kb + 2 + t / 2
      const int in = (t / 2) * 4;
      const uint32_t* p0 = reinterpret_cast<const uint32_t*>(ws + wchunk<C>(r0, kb) + in);
      const uint32_t* p1 = reinterpret_cast<const uint32_t*>(ws + wchunk<C>(r1, kb) + in);
      q[0] = bytes(p0[0]);
      q[1] = bytes(p1[0]);
      q[2] = bytes(p0[2]);
      q[3] = bytes(p1[2]);
    }
    const uint32_t s0 = __byte_perm(sb0, 0u, 0x1010), b0 = __byte_perm(sb0, 0u, 0x3232);
    const uint32_t s1 = __byte_perm(sb1, 0u, 0x1010), b1 = __byte_perm(sb1, 0u, 0x3232);
    a[0] = h2_fma<T>(s0, q[0], b0);
    a[1] = h2_fma<T>(s1, q[1], b1);
    a[2] = h2_fma<T>(s0, q[2], b0);
    a[3] = h2_fma<T>(s1, q[3], b1);
  }
};

// ---------------------------------------------------------------------------------------------
// mma.sync consumer (sm_80+): WR x (8 / WR) warps over (BN weight rows, BM tokens), each a
// (16 MI) x (BM / (8 / WR)) tile of m16n8k16 accumulators
// ---------------------------------------------------------------------------------------------

// Zero an accumulator array (a consumer's acc, or its register ring of A fragments).
template <typename E, int I, int J, int L>
__device__ __forceinline__ void zero_regs(E (&r)[I][J][L]) {
#pragma unroll
  for (int i = 0; i < I; ++i)
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int l = 0; l < L; ++l) r[i][j][l] = E(0);
}

template <class C, int MI_, int WR>
struct QMmaConsumer {
  using T = typename C::T;
  static constexpr bool ASYNC = false;
  static constexpr int MI = MI_;
  static constexpr int WT = 8 / WR;
  static constexpr int NJ = C::BM / WT / 8;  // n8 token blocks per warp
  static_assert(WR * 16 * MI == C::BN, "the warps' rows cover the weight tile");
  static_assert(C::OUT_N % (16 * MI) == 0, "a warp's rows belong to one operand");
  static_assert(NJ % 2 == 0, "token blocks are loaded two at a time");
  float acc[MI][NJ][4];
  int wr, wt, lane;

  __device__ QMmaConsumer(int warp, int lane_) : wr(warp % WR), wt(warp / WR), lane(lane_) {
    zero_regs(acc);
  }

  __device__ __forceinline__ int row16(int i) const { return (wr * MI + i) * 16; }
  __device__ __forceinline__ int tok0() const { return wt * NJ * 8; }

  // One 64-k stage; arrives on `cur` when it no longer reads the slot.
  __device__ __forceinline__ void stage(const unsigned char* xs, const unsigned char* ws,
                                        const uint32_t (&sb)[MI][2][C::GPS], const QFrag<C>& fr,
                                        uint64_t*, uint64_t* cur) {
    const uint32_t xa = smem_addr(xs);
    // Rolled: an unrolled stage lets ptxas hoist the next steps' fragments past 168 registers.
#pragma unroll 1
    for (int kb = 0; kb < 4; ++kb) {
      uint32_t a[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const bool hi = C::GPS == 2 && kb >= 2;  // gs 32: the stage's second group
        fr(ws, row16(i), kb, hi ? sb[i][0][C::GPS - 1] : sb[i][0][0],
           hi ? sb[i][1][C::GPS - 1] : sb[i][1][0], a[i]);
      }
#pragma unroll
      for (int j = 0; j < NJ; j += 2) {
        const int r = tok0() + j * 8 + (lane / 16) * 8 + (lane % 8);
        uint32_t t4[4];
        ldmatrix_x4(t4, xa + swz(r, 2 * kb + (lane / 8) % 2));
        const uint32_t b0[2] = {t4[0], t4[1]}, b1[2] = {t4[2], t4[3]};
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          mma_16816<T>(acc[i][j], a[i], b0);
          mma_16816<T>(acc[i][j + 1], a[i], b1);
        }
      }
    }
    mbar_arrive(cur);
  }

  __device__ __forceinline__ void drain() {}
};

template <class C, bool WGMMA, int MI, int WR, int DEPTH>
struct QConsumerOf;
template <class C, int MI, int WR, int DEPTH>
struct QConsumerOf<C, false, MI, WR, DEPTH> {
  using type = QMmaConsumer<C, MI, WR>;
};

// ---------------------------------------------------------------------------------------------
// The block: pipeline, mainloop, epilogue
// ---------------------------------------------------------------------------------------------

// One block tile of the output: rows m0 .. m0 + BM of `map` (QRows), columns n0 .. n0 + OUT_N
// of each of the NB weights (w, scales, biases) of N rows, K deep; op(accumulators) -> y with
// N columns, rows by map.dst. smem: the dynamic shared memory (C::SMEM bytes, aligned here to
// 1024). Every thread of the block calls it.
template <class C, bool WGMMA, int MI, int WR, int DEPTH, class Rows, class Op>
__device__ __forceinline__ void qgemm_tile(unsigned char* smem_raw, const Rows& map, int N,
                                           int n0, const void* const (&w)[C::NB],
                                           const typename C::T* const (&s)[C::NB],
                                           const typename C::T* const (&b)[C::NB], const Op& op,
                                           typename C::T* y) {
  using T = typename C::T;
  using Cons = typename QConsumerOf<C, WGMMA, MI, WR, DEPTH>::type;
  unsigned char* smem = align_smem(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::BAR_OFF);
  uint64_t* empty = full + C::STAGES;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int K = map.K;
  if (dynamic_smem_size() < uint32_t(C::SMEM) || blockDim.x != kQThreads) __trap();  // launch
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < C::STAGES; ++i) {
      mbar_init(full + i, kQProducers);
      mbar_init(empty + i, kQConsumers);
    }
  }
  __syncthreads();
  const int steps = (K + C::BK - 1) / C::BK;

  if (tid >= kQConsumers) {  // the producer warpgroup
    if constexpr (WGMMA) setmaxnreg_dec<kQProducerRegs>();
    const QProducer<C> pr(map, w, N, n0, reinterpret_cast<long*>(smem + C::ROWS_OFF),
                          tid - kQConsumers);
    for (int st = 0; st < steps; ++st) {
      const int slot = st % C::STAGES;
      mbar_wait(empty + slot, ((st / C::STAGES) & 1) ^ 1);
      pr.stage(smem + slot * C::X_SLOT, smem + C::W_OFF + slot * C::W_SLOT, full + slot,
               st * C::BK);
    }
    cp_async_commit();
    cp_async_wait<0>();
    return;
  }

  if constexpr (WGMMA) setmaxnreg_inc<kQConsumerRegs>();
  Cons cons(warp, lane);
  const QFrag<C> fr(lane);
  const QScales<C, MI> sc(s, b, N, K, n0, lane / 4, [&](int i) { return cons.row16(i); });
  uint32_t sb[MI][2][C::GPS], sb_next[MI][2][C::GPS];
  sc.fetch(0, sb_next);
  for (int st = 0; st < steps; ++st) {
    const int slot = st % C::STAGES;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < C::GPS; ++q) sb[i][h][q] = sb_next[i][h][q];
    if (st + 1 < steps) sc.fetch(st + 1, sb_next);  // in flight during this stage
    mbar_wait(full + slot, (st / C::STAGES) & 1);
    if constexpr (Cons::ASYNC) fence_proxy_async();  // cp.async data -> wgmma's async proxy
    cons.stage(smem + slot * C::X_SLOT, smem + C::W_OFF + slot * C::W_SLOT, sb, fr,
               st > 0 ? empty + (st - 1) % C::STAGES : nullptr, empty + slot);
  }
  cons.drain();

  // Stage the accumulators as float rows out[b][token][column] (pitch PITCH: lanes (g, t)
  // write banks 8 t + g, conflict-free), then 8 columns per thread and pass.
  bar_sync(1, kQConsumers);  // every consumer left the ring
  float* out = reinterpret_cast<float*>(smem);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < Cons::NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = cons.row16(i) + g + 8 * (e / 2);
        const int m = cons.tok0() + 8 * j + 2 * t + (e % 2);
        out[((r / C::OUT_N) * C::BM + m) * C::PITCH + r % C::OUT_N] = cons.acc[i][j][e];
      }
  bar_sync(1, kQConsumers);
  constexpr int U = C::OUT_N / 8;
  for (int u = tid; u < C::BM * U; u += kQConsumers) {
    const int m = u / U, c8 = (u % U) * 8;
    const long row = map.dst(m);
    const int col = n0 + c8;
    if (row < 0 || col >= N) continue;
    float v[C::NB][8];
#pragma unroll
    for (int bb = 0; bb < C::NB; ++bb) {
      const float4* p = reinterpret_cast<const float4*>(out + (bb * C::BM + m) * C::PITCH + c8);
      const float4 lo = p[0], hi = p[1];
      v[bb][0] = lo.x, v[bb][1] = lo.y, v[bb][2] = lo.z, v[bb][3] = lo.w;
      v[bb][4] = hi.x, v[bb][5] = hi.y, v[bb][6] = hi.z, v[bb][7] = hi.w;
    }
    const int nv = min(8, N - col);
    float o[8];
    op(v, row, col, nv, o);
    T* dst = y + row * N + col;
    if (nv == 8 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]),
                                                  pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
    } else {
      for (int e = 0; e < nv; ++e) dst[e] = from_float<T>(o[e]);
    }
  }
}

// The dense GEMM: Y (M, N) = X (M, K) W^T, x (M, K) row-contiguous, block tiles in grouped
// order over a 1-D grid.
template <class C, bool WGMMA, int MI, int WR, int DEPTH, class Op>
__device__ __forceinline__ void qgemm_block(unsigned char* smem, const typename C::T* x, int M,
                                            int K, int N, const void* const (&w)[C::NB],
                                            const typename C::T* const (&s)[C::NB],
                                            const typename C::T* const (&b)[C::NB], const Op& op,
                                            typename C::T* y) {
  int tm, tn;
  grouped_tile<8>(int(blockIdx.x), (M + C::BM - 1) / C::BM, (N + C::OUT_N - 1) / C::OUT_N, tm,
                  tn);
  const QRows<typename C::T, false, false> map{x, nullptr, 1, M, K, tm * C::BM};
  qgemm_tile<C, WGMMA, MI, WR, DEPTH>(smem, map, N, tn * C::OUT_N, w, s, b, op, y);
}

}  // namespace bricks

// Every kernel built with this header runs kQThreads threads: say so to ptxas (mx.fast.
// cuda_kernel writes the signature, so the bound comes in through the __global__ macro).
#ifndef BRICKS_HOST_EMULATION
#undef __global__
#define __global__ __location__(global) __launch_bounds__(::bricks::kQThreads, 1)
#endif

#endif  // MLX_BRICKS_QGEMM_CUH
