// attention.cuh -- the CUDA twin of the FlashAttention prefill brick (body: attention.cu).
// Needs mma.cuh, attention_common.cuh (the tile logic, softmax and store both attention
// kernels share) and attention_stage.cuh (its tile loads) before it.
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

#ifndef MLX_BRICKS_ATTENTION_COMMON_CUH  // built from files (tests): else concatenated before
#include "attention_common.cuh"
#include "attention_stage.cuh"
#endif

namespace bricks {
namespace attn {

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
