// attention_fa.cuh -- FlashAttention prefill for 16-bit q/k/v, the fast family (body:
// attention_fa.cu). Needs mma.cuh, attention_common.cuh (tile ranges, masks, online softmax,
// store) and attention_wgmma.cuh before it.
//
// Algorithm: FlashAttention-2 (Dao 2023) on two tensor-core engines, chosen per variant:
//   mma.sync (sm_80+; WG = false): NW warps of 16 MT query rows each; S = Q K^T and O += P V on
//     m16n8k16, K fragments by ldmatrix, V fragments by ldmatrix.trans, Q fragments in
//     registers where they fit (QREG: MT * DQK <= 128) else ldmatrix per k step.
//   wgmma (sm_90a; WG = true): NW / 4 warpgroups of 64 rows each (FlashAttention-3's consumer
//     warpgroups, Shah et al. 2024); S = Q K^T with both operands in shared memory, O += P V
//     with P in registers and V read transposed (MN-major) from shared memory.
// A block takes BQ = 16 MT NW query rows of one (batch, head) and streams K/V tiles of BK keys
// through an NS-stage cp.async ring (every thread loads; one block barrier per tile):
//
//   wait K/V_t; fence.proxy.async (wgmma); sync | issue K/V_{t+NS-1} | S_t; softmax; O += P V_t
//
// LAG (two warpgroups): warpgroup 1 runs each tile's P V one step late (PV_{t-1}, then S_t and
// its softmax), so while warpgroup 0 runs its softmax the tensor cores take warpgroup 1's MMAs
// and the other way round (FlashAttention-3's ping-pong, without named barriers: the one block
// barrier per tile keeps the order). V then needs one stage more (NSV = NS + 1).
//
// Everything that decides which keys a row sees, the online softmax in the log2 domain (scores
// float32, the scale applied to the float32 accumulator, masked keys at the lowest finite
// float, sinks as a starting column), the tile skipping (causal bottom-right, window, kv_start)
// and the store are attention_common.cuh's, shared with the other kernel; lengths, window and
// kv_start are run-time values (one build per head_dim, dtype and feature set).
//
// Shared memory: Q (BQ rows), NS K stages, NSV V stages, each a 128-byte-swizzled tile of
// 64-column panels (attention_wgmma.cuh: the layout wgmma reads; for ldmatrix it is
// conflict-free), 1024-byte aligned at run time (1 KB of slack in SMEM). head_dim DQK (q, k) and
// DV (v, out) are multiples of 64 and may differ (MLA: 192 / 128).
#ifndef MLX_BRICKS_ATTENTION_FA_CUH
#define MLX_BRICKS_ATTENTION_FA_CUH

namespace bricks {
namespace attn {

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile of R rows: panel c / 8
// (R rows of 128 bytes), the row's line, chunk (c % 8) ^ (r % 8).
__host__ __device__ constexpr int sw128(int r, int c, int R) {
  return (c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

template <typename T, int DQK_, int DV_, int BK_, int NW_, int MT_, int NS_, bool WG_, bool LAG_,
          bool IWO_, bool FFMA_>
struct FaConfig {
  static constexpr int DQK = DQK_, DV = DV_, BK = BK_, NW = NW_, MT = MT_, NS = NS_;
  static constexpr bool WG = WG_, LAG = LAG_, IWO = IWO_;
  static constexpr bool FFMA = FFMA_;  // unmasked, uncapped tiles: softmax_probs<FAST>
  static constexpr bool F32 = false;                   // (store_rows)
  static constexpr int NT = 32 * NW;                   // threads
  static constexpr int BQ = 16 * MT * NW;              // query rows per block
  static constexpr int NSV = NS + (LAG || IWO ? 1 : 0);  // V stages
  static constexpr bool QREG = !WG && MT * DQK <= 128;  // Q fragments in registers
  static constexpr int QM = QREG ? MT : 1, QK = QREG ? DQK / 16 : 1;
  static constexpr int Q_OFF = 0;
  static constexpr int K_BYTES = BK * DQK * 2;  // one stage
  static constexpr int V_BYTES = BK * DV * 2;
  static constexpr int K_OFF = Q_OFF + BQ * DQK * 2;
  static constexpr int V_OFF = K_OFF + NS * K_BYTES;
  static constexpr int SMEM = V_OFF + NSV * V_BYTES + 1024;  // + alignment slack

  static_assert(sizeof(T) == 2, "16-bit q/k/v only (the other kernel takes float32 and Q8_0)");
  static_assert(DQK % 64 == 0 && DV % 64 == 0, "head_dim must be a multiple of 64");
  static_assert(BK % 16 == 0 && BK >= 16, "BK must be a positive multiple of 16");
  static_assert(NS >= 2, "at least two K/V stages");
  static_assert(MT == 1 || MT == 2, "MT (m16 tiles per warp) must be 1 or 2");
  static_assert(!WG || (MT == 1 && NW % 4 == 0 && DV <= 256 && BK <= 256),
                "wgmma: whole warpgroups of 64 rows, N <= 256");
  static_assert(!LAG || (WG && NW == 8), "LAG: two warpgroups");
  static_assert(!IWO || (WG && !LAG), "IWO: wgmma, not with LAG");
};

// Stage rows row0 .. row0 + R - 1 (D elements each) of a strided global matrix into the
// swizzled tile at dst. Thread tid takes chunk c = tid % 8 of every panel of rows
// tid / 8 + i * NT / 8: 8 threads cover one 128-byte line (coalesced reads, conflict-free
// writes), and as NT / 8 is a multiple of 8 the swizzle of a thread's rows never changes, so
// one global pointer (advanced by a constant) and one shared address plus compile-time offsets
// serve every chunk (no per-chunk address stays live across the key loop). Rows >= nvalid and
// rows < nlo (a padded batch row's padding keys, never read) become zeros. fast (uniform):
// unit column stride and 16-byte aligned rows, so 16-byte cp.async chunks; else element-wise
// bit copies. Caller commits the cp.async group.
template <int R, int D, int NT>
__device__ __forceinline__ void stage_rows(unsigned char* dst, const uint16_t* src, int64_t rs,
                                           int64_t cs, int row0, int nvalid, int nlo, bool fast,
                                           int tid) {
  constexpr int RPI = NT / 8, ITERS = (R + RPI - 1) / RPI, PANELS = D / 64;
  static_assert(NT % 64 == 0, "NT / 8 threads per chunk column must be a multiple of 8 rows");
  const int r = tid / 8, c = tid % 8;
  const int lane_off = sw128(r, c, R);  // + panel * R * 128 + i * RPI * 128 (r % 8 is fixed)
  if (fast) {
    const uint32_t d = smem_addr(dst) + uint32_t(lane_off);
    const uint16_t* sp = src + int64_t(row0 + r) * rs + c * 8;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
      const int row = row0 + r + i * RPI;
      if (R % RPI == 0 || r + i * RPI < R) {
        const bool ok = row < nvalid && row >= nlo;
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn) {
          cp_async16(d + uint32_t(pn * R * 128 + i * RPI * 128), ok ? sp + pn * 64 : src, ok);
        }
      }
      sp += int64_t(RPI) * rs;
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < ITERS; ++i) {
      const int row = row0 + r + i * RPI;
      if (R % RPI == 0 || r + i * RPI < R) {
        const bool ok = row < nvalid && row >= nlo;
        for (int pn = 0; pn < PANELS; ++pn) {
          uint16_t* dd = reinterpret_cast<uint16_t*>(dst + lane_off + pn * R * 128 + i * RPI * 128);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            dd[e] = ok ? src[int64_t(row) * rs + int64_t(pn * 64 + c * 8 + e) * cs] : 0;
          }
        }
      }
    }
  }
}

// ---- mma.sync engine ----
// Per-lane part of a swizzled ldmatrix address: the lane's row rl of a 16-row block and its
// chunk bit hi (the 16-byte half of a 32-byte k16 column pair), XOR-ed with the row's swizzle.
// Chunk pair c2 (0..3) of a panel is then lane ^ (c2 << 5): the swizzle XOR distributes over
// the pair's bits, and every other term of the address is a multiple of 128.
__device__ __forceinline__ uint32_t ldm_lane(int rl, int hi) {
  return uint32_t(rl * 128 + ((hi ^ (rl & 7)) << 4));
}

struct LdmLanes {
  uint32_t q, k, v;
};

// q: A (16 x 16, row r = lane % 16, chunk lane / 16); k: two n8 B blocks of an (n, k) tile
// (n = (lane / 16) * 8 + lane % 8, chunk (lane / 8) % 2); v: .trans, matrix lane / 8 at keys
// (lane / 8) % 2 * 8 + lane % 8, chunk lane / 16 (mma.cuh's fragment notes).
__device__ __forceinline__ LdmLanes ldm_lanes(int lane) {
  return LdmLanes{ldm_lane(lane % 16, lane / 16), ldm_lane((lane / 16) * 8 + lane % 8, (lane / 8) % 2),
                  ldm_lane(lane % 8 + ((lane / 8) % 2) * 8, lane / 16)};
}

// Q fragments of this warp's rows (QREG), loaded once.
template <class C>
__device__ __forceinline__ void q_fragments(uint32_t (&qf)[C::QM][C::QK][4], uint32_t q_rows,
                                            uint32_t q_lane) {
  if constexpr (C::QREG) {
#pragma unroll
    for (int m = 0; m < C::MT; ++m)
#pragma unroll
      for (int kk = 0; kk < C::DQK / 16; ++kk)
        ldmatrix_x4(qf[m][kk], q_rows + uint32_t((kk / 4) * C::BQ * 128 + m * 2048) +
                                   (q_lane ^ uint32_t((kk % 4) << 5)));
  }
}

// S = Q K^T for the warp's 16 MT rows; q_rows: the Q tile at the warp's first row, ks: the K
// stage.
template <class C, typename T>
__device__ __forceinline__ void qk_mma(float (&s)[C::MT][C::BK / 8][4],
                                       const uint32_t (&qf)[C::QM][C::QK][4], uint32_t q_rows,
                                       uint32_t ks, LdmLanes ln) {
#pragma unroll
  for (int m = 0; m < C::MT; ++m)
#pragma unroll
    for (int j = 0; j < C::BK / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[m][j][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < C::DQK / 16; ++kk) {
    const uint32_t swz = uint32_t((kk % 4) << 5);
    uint32_t qa[C::MT][4];
#pragma unroll
    for (int m = 0; m < C::MT; ++m) {
      if constexpr (C::QREG) {
#pragma unroll
        for (int e = 0; e < 4; ++e) qa[m][e] = qf[m][kk][e];
      } else {
        ldmatrix_x4(qa[m], q_rows + uint32_t((kk / 4) * C::BQ * 128 + m * 2048) + (ln.q ^ swz));
      }
    }
#pragma unroll
    for (int jp = 0; jp < C::BK / 16; ++jp) {
      uint32_t kb[4];
      ldmatrix_x4(kb, ks + uint32_t((kk / 4) * C::BK * 128 + jp * 2048) + (ln.k ^ swz));
      const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
      for (int m = 0; m < C::MT; ++m) {
        mma_16816<T>(s[m][2 * jp], qa[m], b0);
        mma_16816<T>(s[m][2 * jp + 1], qa[m], b1);
      }
    }
  }
}

// O += P V for the warp's rows; vs: the V stage.
template <class C, typename T>
__device__ __forceinline__ void pv_mma(float (&o)[C::MT][C::DV / 8][4],
                                       const uint32_t (&p)[C::MT][C::BK / 16][4], uint32_t vs,
                                       LdmLanes ln) {
#pragma unroll
  for (int kk = 0; kk < C::BK / 16; ++kk) {
#pragma unroll
    for (int dn = 0; dn < C::DV / 16; ++dn) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, vs + uint32_t((dn / 4) * C::BK * 128 + kk * 2048) +
                                (ln.v ^ uint32_t((dn % 4) << 5)));
      const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
      for (int m = 0; m < C::MT; ++m) {
        mma_16816<T>(o[m][2 * dn], p[m][kk], b0);
        mma_16816<T>(o[m][2 * dn + 1], p[m][kk], b1);
      }
    }
  }
}

// ---- wgmma engine (the warpgroup's 64 rows; attention_wgmma.cuh) ----
template <int N>
__device__ __forceinline__ void wg_fence_all(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wg_reg_fence(d[i]);
}

// Issue S = Q K^T (one commit group): q_rows the Q tile at the warpgroup's first row, ks the K
// stage (both K-major).
template <class C, typename T>
__device__ __forceinline__ void qk_issue(float (&s)[1][C::BK / 8][4], uint32_t q_rows,
                                         uint32_t ks) {
  float(&d)[C::BK / 2] = reinterpret_cast<float(&)[C::BK / 2]>(s);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < C::DQK / 16; ++kk) {
    const uint32_t col = uint32_t((kk % 4) * 32);
    WgSS<C::BK, T>::run(d, Sw128Desc::k_major(q_rows + uint32_t((kk / 4) * C::BQ * 128) + col),
                        Sw128Desc::k_major(ks + uint32_t((kk / 4) * C::BK * 128) + col),
                        kk > 0 ? 1u : 0u);
  }
  wg_commit();
}

// Issue O += P V (one commit group): vs the V stage, read MN-major (keys are the k axis).
template <class C, typename T>
__device__ __forceinline__ void pv_issue(float (&o)[1][C::DV / 8][4],
                                         const uint32_t (&p)[1][C::BK / 16][4], uint32_t vs) {
  float(&d)[C::DV / 2] = reinterpret_cast<float(&)[C::DV / 2]>(o);
  wg_fence_all(d);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < C::BK / 16; ++kk) {
    WgRS<C::DV, T>::run(d, p[0][kk], Sw128Desc::mn_major(vs + uint32_t(kk * 2048), C::BK * 128));
  }
  wg_commit();
}

// Wait for this thread's wgmma groups but the newest N, then fence acc's registers (their
// values are the products' only from here on).
template <int N, int R, int C2>
__device__ __forceinline__ void wg_complete(float (&acc)[1][R][C2]) {
  wg_wait<N>();
  wg_fence_all(reinterpret_cast<float(&)[R * C2]>(acc));
}

// P (the softmax's probabilities, in S's accumulator layout) as k16 A fragments: the C layout
// of n8 blocks 2 kk and 2 kk + 1 is the A layout of k step kk.
template <typename T, int MT, int BK>
__device__ __forceinline__ void pack_p(uint32_t (&p)[MT][BK / 16][4],
                                       const float (&s)[MT][BK / 8][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      p[m][kk][0] = pack2<T>(s[m][2 * kk][0], s[m][2 * kk][1]);
      p[m][kk][1] = pack2<T>(s[m][2 * kk][2], s[m][2 * kk][3]);
      p[m][kk][2] = pack2<T>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
      p[m][kk][3] = pack2<T>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
    }
}

// The whole kernel. Inputs as attention.cu's minus the Q8_0 scales: q (B, Hq, Lq, DQK),
// k (B, Hkv, Lk, DQK), v (B, Hkv, Lk, DV), any strides; fparams (scale, softcap, 1 / softcap),
// iparams (window,); kv_start (B,) int32 with KV_START, sinks (Hq,) float with SINKS. Output
// out (B, Lq, Hq, DV), every element written; a row that sees no key is 0.
template <class C, typename T, bool CAUSAL, bool WINDOW, bool SOFTCAP, bool KV_START, bool SINKS>
__device__ __forceinline__ void fa_forward(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ fparams, const int32_t* __restrict__ iparams,
    const int32_t* __restrict__ kv_start, int64_t kv_start_stride,
    const float* __restrict__ sinks, int64_t sinks_stride, T* __restrict__ out, Dims dims,
    Strides4 qs, Strides4 ks, Strides4 vs, unsigned char* smem_raw) {
  constexpr int BK = C::BK, MT = C::MT, NT = C::NT, NB = BK / 8, ND = C::DV / 8;
  constexpr bool UPPER = CAUSAL || WINDOW;  // a window implies causal (p - window < j <= p)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  // A build error, not a trap at run time (which would end the process's CUDA context).
  static_assert(!C::WG, "the wgmma variants need sm_90a");
#endif
  if (dynamic_smem_bytes() < uint32_t(C::SMEM)) {
    __trap();  // launched with less shared memory than this variant lays out
  }
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = smem_addr(smem);

  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  // The MMA unit (a warpgroup of 64 rows with wgmma, else the warp) and this warp's rows.
  constexpr int UROWS = C::WG ? 64 : 16 * MT;
  const int wg = warp / 4;
  const int unit_row = C::WG ? wg * 64 : warp * 16 * MT;
  const int warp_row = C::WG ? unit_row + (warp % 4) * 16 : unit_row;

  const int qblock = int(gridDim.x) - 1 - int(blockIdx.x);  // heaviest causal blocks first
  const int h = int(blockIdx.y), b = int(blockIdx.z);
  const int Lq = dims.Lq, Lk = dims.Lk;
  const int hk = h / (dims.Hq / dims.Hkv);  // GQA
  const int diag = Lk - Lq;                 // query row i sits at key position i + diag
  const int q0 = qblock * C::BQ;
  const int wrow0 = q0 + warp_row, urow0 = q0 + unit_row;
  const int wlast = min(wrow0 + 16 * MT, Lq) - 1, ulast = min(urow0 + UROWS, Lq) - 1;

  const RunParams<WINDOW, SOFTCAP, KV_START, SINKS> rp(fparams, iparams, kv_start,
                                                       kv_start_stride, sinks, sinks_stride, b,
                                                       h, Lk);
  const int window = rp.window, kv_lo = rp.kv_lo;

  const TileRange tiles =
      block_tiles(q0, min(q0 + C::BQ, Lq) - 1, diag, Lk, BK, UPPER, WINDOW, window, kv_lo);
  const int t_begin = tiles.t_begin, t_end = tiles.t_end;

  const T* qg = q + int64_t(b) * qs.b + int64_t(h) * qs.h;
  const T* kg = k + int64_t(b) * ks.b + int64_t(hk) * ks.h;
  const T* vg = v + int64_t(b) * vs.b + int64_t(hk) * vs.h;
  const bool q_fast = qs.d == 1 && (qs.l * 2) % 16 == 0 && aligned16(qg);
  const bool k_fast = ks.d == 1 && (ks.l * 2) % 16 == 0 && aligned16(kg);
  const bool v_fast = vs.d == 1 && (vs.l * 2) % 16 == 0 && aligned16(vg);

  auto issue = [&](int t) {
    stage_rows<BK, C::DQK, NT>(smem + C::K_OFF + (t % C::NS) * C::K_BYTES,
                               reinterpret_cast<const uint16_t*>(kg), ks.l, ks.d, t * BK, Lk,
                               kv_lo, k_fast, tid);
    stage_rows<BK, C::DV, NT>(smem + C::V_OFF + (t % C::NSV) * C::V_BYTES,
                              reinterpret_cast<const uint16_t*>(vg), vs.l, vs.d, t * BK, Lk,
                              kv_lo, v_fast, tid);
  };

  // Prologue: Q (its own group), then tiles t_begin .. t_begin + NS - 2; Q lands first.
  stage_rows<C::BQ, C::DQK, NT>(smem + C::Q_OFF, reinterpret_cast<const uint16_t*>(qg), qs.l,
                                qs.d, q0, Lq, 0, q_fast, tid);
  cp_async_commit();
#pragma unroll
  for (int i = 0; i < C::NS - 1; ++i) {
    if (t_begin + i < t_end) issue(t_begin + i);
    cp_async_commit();
  }
  cp_async_wait<C::NS - 1>();
  __syncthreads();

  const LdmLanes ln = ldm_lanes(lane);
  const uint32_t q_rows = sbase + C::Q_OFF + uint32_t(warp_row * 128);  // mma.sync: the warp's
  uint32_t qf[C::QM][C::QK][4];
  q_fragments<C>(qf, q_rows, ln.q);

  float o[MT][ND][4];
  float m_run[MT][2], l_run[MT][2];  // l_run: per-lane partial row sums (store_rows sums)
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int i = 0; i < ND; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[m][i][e] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_run[m][r] = SINKS ? rp.sink2 : kMasked;
      l_run[m][r] = SINKS && tq == 0 ? 1.0f : 0.0f;
    }
  }
  uint32_t p[MT][BK / 16][4];
  bool p_pending = false;  // LAG (warpgroup 1) / IWO: the previous tile's P V is still to run
  uint32_t p_stage = 0;

  for (int t = t_begin; t < t_end; ++t) {
    const int kv0 = t * BK;
    cp_async_wait<C::NS - 2>();  // tile t landed (this thread's chunks)
    if constexpr (C::WG) fence_proxy_async();
    __syncthreads();  // everyone's chunks landed; every unit is done with tile t - 1's stages
    if (t + C::NS - 1 < t_end) issue(t + C::NS - 1);
    cp_async_commit();

    const uint32_t kst = sbase + C::K_OFF + uint32_t((t % C::NS) * C::K_BYTES);
    const uint32_t vst = sbase + C::V_OFF + uint32_t((t % C::NSV) * C::V_BYTES);
    if constexpr (C::LAG) {
      if (p_pending) {
        pv_issue<C, T>(o, p, p_stage);
        wg_complete<0>(o);
        p_pending = false;
      }
    }
    // A unit whose rows see no key of this tile skips it (uniform in the unit).
    if (urow0 < Lq && tile_active(kv0, BK, urow0, ulast, diag, UPPER, WINDOW, window, kv_lo)) {
      // Only tiles that cross Lk, the diagonal, the window edge or kv_lo need the mask.
      const bool need_mask =
          tile_needs_mask(kv0, BK, wrow0, wlast, diag, Lk, UPPER, WINDOW, window, kv_lo);
      const bool fast = !SOFTCAP && !need_mask && rp.pre > 0.0f;
      float s[MT][NB][4], factor[MT][2];
      if constexpr (C::WG) {
        qk_issue<C, T>(s, sbase + C::Q_OFF + uint32_t(unit_row * 128), kst);
        if (C::IWO && p_pending) {  // the previous tile's P V runs under this softmax
          pv_issue<C, T>(o, p, p_stage);
          wg_complete<1>(s);
        } else {
          wg_complete<0>(s);
        }
      } else {
        qk_mma<C, T>(s, qf, q_rows, kst, ln);
      }
      if (C::FFMA && !SOFTCAP && fast) {
        softmax_probs<false, false, UPPER, WINDOW, BK, MT, C::FFMA && !SOFTCAP>(
            s, m_run, l_run, factor, rp.pre, rp.post, false, wrow0, diag, kv0, Lk, window, kv_lo,
            g, tq);
      } else {
        softmax_probs<false, SOFTCAP, UPPER, WINDOW, BK, MT>(s, m_run, l_run, factor, rp.pre,
                                                            rp.post, need_mask, wrow0, diag, kv0,
                                                            Lk, window, kv_lo, g, tq);
      }
      if constexpr (C::IWO) {
        if (p_pending) wg_complete<0>(o);  // P V_{t-1} done: O and p are free
      }
      rescale_o<MT, ND>(o, factor);
      pack_p<T, MT, BK>(p, s);
      if constexpr (C::LAG || C::IWO) {
        if (C::IWO || wg == 1) {
          p_pending = true;
          p_stage = vst;
        } else {
          pv_issue<C, T>(o, p, vst);
          wg_complete<0>(o);
        }
      } else if constexpr (C::WG) {
        pv_issue<C, T>(o, p, vst);
        wg_complete<0>(o);
      } else {
        pv_mma<C, T>(o, p, vst, ln);
      }
    } else if constexpr (C::IWO) {
      if (p_pending) {  // a skipped tile: the pending P V runs now
        pv_issue<C, T>(o, p, p_stage);
        wg_complete<0>(o);
        p_pending = false;
      }
    }
  }
  if constexpr (C::LAG || C::IWO) {
    if (p_pending) {  // its V stage is never refilled after the loop
      pv_issue<C, T>(o, p, p_stage);
      wg_complete<0>(o);
    }
  }
  cp_async_wait<0>();  // nothing may stay in flight past the kernel's end

  store_rows<C, T, C::DV, MT, ND>(out, o, l_run, int64_t(b), h, Lq, dims.Hq, wrow0, 0, g, tq);
}

}  // namespace attn
}  // namespace bricks

#endif  // MLX_BRICKS_ATTENTION_FA_CUH
