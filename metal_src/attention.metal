// Brick 4: FlashAttention prefill (FlashAttention-2 online softmax, Dao 2023) with causal,
// bottom-right and sliding-window masks as parameters (whole K/V tiles outside them skipped),
// logit soft-capping, GQA and Q8_0 K/V. Headers: q8_0.h, gemm.h, attention.h.
//
// Template: T (dtype of q, of k/v unless KV_Q8, and of out), D (head_dim of q and k, multiple
// of 8 * WD), DV (head_dim of v and out, multiple of 8 * WD: D for plain attention, less for
// multi-head latent attention, e.g. 192 / 128), BK (keys per K/V tile, multiple of 8), WQ
// (8-row query blocks per threadgroup), WD (SIMD-groups splitting the head dims: each owns
// D / WD columns of Q and DV / WD columns of O), KV_SHARED (K and V take turns in one
// threadgroup buffer), CAUSAL (bottom-right aligned), WINDOW (sliding window, needs CAUSAL),
// SOFTCAP (s = cap * tanh(s / cap)), KV_Q8 (k/v are Q8_0), KV_START (per-batch-row first valid
// key: a left-padded batch), SINKS (a learned logit per query head in the softmax, gpt-oss).
// Inputs (any strides):
//   q (B, Hq, Lq, D) T
//   k (B, Hkv, Lk, D), v (B, Hkv, Lk, DV): T, or int8 quants when KV_Q8
//   k_scale (B, Hkv, Lk, D / 32), v_scale (B, Hkv, Lk, DV / 32) half Q8_0 scales when KV_Q8,
//     else (1, 1, 1, 1) dummies
//   fparams (3,) float: scale (multiplier of q . k), softcap, 1 / softcap
//   iparams (1,) int: window (query at position p sees keys p - window + 1 .. p)
//   kv_start (B,) int, any stride, when KV_START (else a (1,) dummy, never read): keys
//     j < kv_start[b] are masked for every head and query of batch row b (clamped to 0 .. Lk)
//   sinks (Hq,) float, any stride, when SINKS (else a (1,) dummy, never read): head h's softmax
//     has one more column of score sinks[h] and value 0
// Output: out (B, Lq, Hq, DV) T, every element written.
// Grid: (32 * WQ * WD * ceil(Lq / (8 * WQ)), Hq, B) threads; threadgroup (32 * WQ * WD, 1, 1).
//
// SIMD-group sg owns query rows 8 (sg / WD) .. + 7 of the threadgroup's block and head_dim
// columns (sg % WD) * D / WD .. + D / WD - 1 of Q and (sg % WD) * DV / WD .. + DV / WD - 1 of O:
// its Q slice and O accumulator stay in float simdgroup matrices (DV <= D and D / WD <= 128, so
// at most 2 x 32 floats a lane). With WD > 1 the
// SIMD-groups of one row block each compute a partial Q K^T over their columns, exchange them
// through threadgroup memory and sum them in the same order, so all of them run the same online
// softmax on the same scores and then multiply P by their own V columns.
constexpr int NSG = WQ * WD;
constexpr int NT = 32 * NSG;
constexpr int BQ = 8 * WQ;
constexpr int DS = D / WD;  // head_dim columns per SIMD-group
constexpr int DF = DS / 8;
constexpr int KF = BK / 8;
constexpr int VW = 16 / int(sizeof(T));
constexpr int DVS = DV / WD;  // value (output) columns per SIMD-group
constexpr int DVF = DVS / 8;
constexpr int LD = D + VW;  // K and V tiles: [key][d], rows padded by 16 bytes
constexpr int LDV = DV + VW;
constexpr int KV_TILE = BK * LD;
constexpr int V_TILE = BK * LDV;
// K and V side by side, or taking turns in one buffer of the larger (KV_SHARED)
constexpr int KV_ELEMS = KV_SHARED ? (KV_TILE > V_TILE ? KV_TILE : V_TILE) : KV_TILE + V_TILE;
constexpr int S_PART = WD > 1 ? NSG * 8 * BK : 1;  // partial scores, float
static_assert(D % (8 * WD) == 0 && BK % 8 == 0, "D / WD and BK must be multiples of 8");
static_assert(DV % (8 * WD) == 0 && DV <= D, "DV / WD must be a multiple of 8, DV <= D");
static_assert(!KV_Q8 || (D % QK8_0 == 0 && DV % QK8_0 == 0), "Q8_0 K/V needs D, DV % 32 == 0");
static_assert(!WINDOW || CAUSAL, "the sliding window needs the causal mask");
static_assert(KV_ELEMS * int(sizeof(T)) + (WD > 1 ? S_PART * 4 : 0) <= ATTN_TG_LIMIT,
              "threadgroup memory over the limit: lower BK or set KV_SHARED");

// Declared as 16-byte chunks so the 128-bit threadgroup stores are aligned.
threadgroup bricks::Vec128<T> kv_store[KV_ELEMS / VW];
threadgroup float s_part[S_PART];
threadgroup T* k_tile = reinterpret_cast<threadgroup T*>(kv_store);
threadgroup T* v_tile = k_tile + (KV_SHARED ? 0 : KV_TILE);

const int Hq = q_shape[1];
const int Lq = q_shape[2];
const int Hkv = k_shape[1];
const int Lk = k_shape[2];
const int qblock = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int hk = h / (Hq / Hkv);  // GQA: Hq / Hkv query heads share one KV head
const int diag = Lk - Lq;        // query row i sits at absolute position i + diag

const float scale = fparams[0];
const float softcap = fparams[1];
const float inv_softcap = fparams[2];
const int window = iparams[0];
// First valid key of this batch row (left padding); 0 without KV_START.
const int kv_lo = KV_START ? clamp(int(kv_start[b * kv_start_strides[0]]), 0, Lk) : 0;

const uint lane = thread_index_in_simdgroup;
const int tid = int(thread_index_in_threadgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int wq = sg / WD;
const int d0 = (sg % WD) * DS;
const int dv0 = (sg % WD) * DVS;
const int row0 = qblock * BQ + 8 * wq;
const int fr = attn_frag_row(lane);
const int fc = attn_frag_col(lane);
const int qrow = row0 + fr;
const bool sg_live = row0 < Lq;

// Keys [kv_begin, kv_end) are all any row of this threadgroup can see; [sg_begin, sg_end) those
// of this SIMD-group's rows. Row at position p sees keys <= p (CAUSAL), > p - window (WINDOW)
// and >= kv_lo (KV_START): whole tiles below kv_lo are skipped as those past the diagonal.
int kv_begin = kv_lo, kv_end = Lk, sg_begin = kv_lo, sg_end = Lk;
if (CAUSAL) {
  kv_end = clamp(min(qblock * BQ + BQ, Lq) + diag, 0, Lk);
  sg_end = clamp(min(row0 + 8, Lq) + diag, 0, Lk);
}
if (WINDOW) {
  kv_begin = max(kv_lo, clamp(qblock * BQ + diag + 1 - window, 0, Lk));
  sg_begin = max(kv_lo, clamp(row0 + diag + 1 - window, 0, Lk));
}
const int t_begin = kv_begin / BK;
const int t_end = (kv_end + BK - 1) / BK;

const int64_t q_base = b * q_strides[0] + h * q_strides[1];
const int64_t k_base = b * k_strides[0] + hk * k_strides[1];
const int64_t v_base = b * v_strides[0] + hk * v_strides[1];

// K/V sources. The 128-bit path needs unit d stride and 16-byte steps between rows.
using KPtr = decltype(k + 0);
using VPtr = decltype(v + 0);
using KSource = typename AttnSourceOf<KV_Q8, T, KPtr, decltype(k_scale + 0)>::type;
using VSource = typename AttnSourceOf<KV_Q8, T, VPtr, decltype(v_scale + 0)>::type;
KSource ksrc;
VSource vsrc;
if constexpr (KV_Q8) {
  ksrc.qs = k + k_base;
  ksrc.scales = k_scale + (b * k_scale_strides[0] + hk * k_scale_strides[1]);
  ksrc.key_stride = k_strides[2];
  ksrc.d_stride = k_strides[3];
  ksrc.scale_key_stride = k_scale_strides[2];
  ksrc.scale_block_stride = k_scale_strides[3];
  ksrc.vec = k_strides[3] == 1;
  vsrc.qs = v + v_base;
  vsrc.scales = v_scale + (b * v_scale_strides[0] + hk * v_scale_strides[1]);
  vsrc.key_stride = v_strides[2];
  vsrc.d_stride = v_strides[3];
  vsrc.scale_key_stride = v_scale_strides[2];
  vsrc.scale_block_stride = v_scale_strides[3];
  vsrc.vec = v_strides[3] == 1;
} else {
  ksrc.base = k + k_base;
  ksrc.key_stride = k_strides[2];
  ksrc.d_stride = k_strides[3];
  ksrc.vec = k_strides[3] == 1 && k_strides[2] % VW == 0 && k_base % VW == 0;
  vsrc.base = v + v_base;
  vsrc.key_stride = v_strides[2];
  vsrc.d_stride = v_strides[3];
  vsrc.vec = v_strides[3] == 1 && v_strides[2] % VW == 0 && v_base % VW == 0;
}

// This SIMD-group's Q slice as raw float fragments: scores are scaled after the product, so
// the dot product rounds as a plain q . k does (see the softmax below).
attn_frag qf[DF];
attn_frag of[DVF];
ATTN_UNROLL
for (int i = 0; i < DVF; ++i) attn_set(of[i], 0.0f, 0.0f);
ATTN_UNROLL
for (int i = 0; i < DF; ++i) {
  float e0 = 0.0f;
  float e1 = 0.0f;
  if (qrow < Lq) {
    const int64_t o = q_base + qrow * q_strides[2] + (d0 + i * 8 + fc) * q_strides[3];
    e0 = float(q[o]);
    e1 = float(q[o + q_strides[3]]);
  }
  attn_set(qf[i], e0, e1);
}

// Running row max of the scaled (and capped) scores and row sum of exp(s - m_run). With SINKS
// the row starts with its sink column already seen: m = sink, l = exp(sink - m) = 1, O = 0; the
// updates below rescale that 1 with the rest of l, so O / l divides by the sink's term too.
float m_run = SINKS ? float(sinks[h * sinks_strides[0]]) : ATTN_MASKED;
float l_run = SINKS ? 1.0f : 0.0f;

for (int t = t_begin; t < t_end; ++t) {
  const int kv0 = t * BK;

  attn_stage_tile<T, D, BK, LD, NT>(k_tile, ksrc, kv0, kv_lo, Lk, tid);
  if (!KV_SHARED) attn_stage_tile<T, DV, BK, LDV, NT>(v_tile, vsrc, kv0, kv_lo, Lk, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // A row block whose rows see no key of this tile skips it (uniform within the row block,
  // so within every SIMD-group; the barriers are met outside).
  const bool active = sg_live && kv0 < sg_end && kv0 + BK > sg_begin;

  // S = Q K^T over this SIMD-group's columns: 8 rows x BK keys, float, unscaled.
  attn_frag sf[KF];
  if (active) {
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      attn_set(sf[j], 0.0f, 0.0f);
      ATTN_UNROLL
      for (int i = 0; i < DF; ++i) {
        const int a = (j * 8 + fc) * LD + d0 + i * 8 + fr;
        attn_frag kf;
        attn_set(kf, float(k_tile[a]), float(k_tile[a + LD]));
        simdgroup_multiply_accumulate(sf[j], qf[i], kf, sf[j]);
      }
    }
  }
  if (WD > 1) {
    // Partial scores out; every SIMD-group of the row block sums the WD partials in order 0..WD-1.
    if (active) {
      ATTN_UNROLL
      for (int j = 0; j < KF; ++j) {
        const int a = (sg * 8 + fr) * BK + j * 8 + fc;
        s_part[a] = sf[j].thread_elements()[0];
        s_part[a + 1] = sf[j].thread_elements()[1];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (active) {
      ATTN_UNROLL
      for (int j = 0; j < KF; ++j) {
        float e0 = 0.0f;
        float e1 = 0.0f;
        ATTN_UNROLL
        for (int w = 0; w < WD; ++w) {
          const int a = ((wq * WD + w) * 8 + fr) * BK + j * 8 + fc;
          e0 += s_part[a];
          e1 += s_part[a + 1];
        }
        attn_set(sf[j], e0, e1);
      }
    }
  }
  if (KV_SHARED) {
    // V takes K's place once every SIMD-group is done reading K.
    if (WD == 1) threadgroup_barrier(mem_flags::mem_threadgroup);
    attn_stage_tile<T, DV, BK, LDV, NT>(v_tile, vsrc, kv0, kv_lo, Lk, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (active) {
    // s = scale * q.k (then cap * tanh(s / cap)); keys outside the mask get ATTN_MASKED. Only
    // tiles that cross Lk, the diagonal, the window edge or kv_lo test keys one by one.
    const bool need_mask = (kv0 + BK > Lk) || (CAUSAL && kv0 + BK - 1 > row0 + diag) ||
                           (WINDOW && kv0 <= row0 + 7 + diag - window) ||
                           (KV_START && kv0 < kv_lo);
    const int pos = qrow + diag;
    float m_new = m_run;
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      ATTN_UNROLL
      for (int e = 0; e < 2; ++e) {
        float s = sf[j].thread_elements()[e] * scale;
        if (SOFTCAP) s = softcap * precise::tanh(s * inv_softcap);
        if (need_mask) {
          const int key = kv0 + j * 8 + fc + e;
          const bool visible = key < Lk && (!CAUSAL || key <= pos) &&
                               (!WINDOW || key > pos - window) && (!KV_START || key >= kv_lo);
          if (!visible) s = ATTN_MASKED;
        }
        sf[j].thread_elements()[e] = s;
        m_new = max(m_new, s);
      }
    }
    m_new = attn_row_max(m_new);

    // Online softmax update in registers. p = exp2(fma(s, log2 e, -m log2 e)): the fma forms
    // s log2 e - m log2 e exactly and rounds once near 0, so large scores (hundreds) keep the
    // accuracy of s; the rounding of m log2 e is common to the whole row and cancels in O / l.
    // A masked key, or a row with no visible key yet, gets p = 0 without calling exp2 (a NaN
    // score is not a masked one: it reaches O as in stock attention).
    const float m2 = m_new * ATTN_LOG2E;
    float l_tile = 0.0f;
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      ATTN_UNROLL
      for (int e = 0; e < 2; ++e) {
        const float s = sf[j].thread_elements()[e];
        const float p = s == ATTN_MASKED ? 0.0f : AttnExp2<T>::eval(fma(s, ATTN_LOG2E, -m2));
        sf[j].thread_elements()[e] = p;
        l_tile += p;
      }
    }
    l_tile = attn_row_sum(l_tile);
    // exp2(0) is 1 exactly here (the fast variant need not return it); no key seen yet: l = O = 0.
    const float factor = m_new == m_run ? 1.0f
                         : m_run > ATTN_MASKED ? AttnExp2<T>::eval(m_run * ATTN_LOG2E - m2)
                                               : 0.0f;
    l_run = l_run * factor + l_tile;
    m_run = m_new;

    // O = O * factor + P V over this SIMD-group's value columns.
    ATTN_UNROLL
    for (int i = 0; i < DVF; ++i) {
      of[i].thread_elements()[0] *= factor;
      of[i].thread_elements()[1] *= factor;
      ATTN_UNROLL
      for (int j = 0; j < KF; ++j) {
        const int a = (j * 8 + fr) * LDV + dv0 + i * 8 + fc;
        attn_frag vf;
        attn_set(vf, float(v_tile[a]), float(v_tile[a + 1]));
        simdgroup_multiply_accumulate(of[i], sf[j], vf, of[i]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// out[b, qrow, h, dv0 + ...] = O / l; a row that saw no key (l = 0) gives 0 instead of 0 / 0
// (a NaN l, from a NaN score, stays NaN); with SINKS such a row has O = 0, l = 1: 0 too.
if (qrow < Lq) {
  const bool any = l_run != 0.0f;
  const uint64_t row = (uint64_t(b) * uint64_t(Lq) + uint64_t(qrow)) * uint64_t(Hq) + uint64_t(h);
  const uint64_t o = row * DV + dv0;
  ATTN_UNROLL
  for (int i = 0; i < DVF; ++i) {
    out[o + i * 8 + fc] = T(any ? of[i].thread_elements()[0] / l_run : 0.0f);
    out[o + i * 8 + fc + 1] = T(any ? of[i].thread_elements()[1] / l_run : 0.0f);
  }
}
