// Brick 4: FlashAttention prefill (FlashAttention-2 online softmax, Dao 2023), causal tile
// skipping, GQA and Q8_0 K/V. Headers: q8_0.h, attention.h.
//
// Template: T (dtype of q, of k/v unless KV_Q8, and of out), D (head_dim, multiple of 8),
// BK (keys per K/V tile, multiple of 8), CAUSAL (bottom-right aligned), KV_Q8 (k/v are Q8_0).
// Inputs (any strides):
//   q (B, Hq, Lq, D) T
//   k, v (B, Hkv, Lk, D): T, or int8 quants when KV_Q8
//   k_scale, v_scale (B, Hkv, Lk, D / 32) half Q8_0 scales when KV_Q8, else (1, 1, 1, 1) dummies
//   sm_scale (1,) float: multiplier of q . k
// Output: out (B, Lq, Hq, D) T, every element written.
// Grid: (32 * ATTN_NSG * ceil(Lq / BQ), Hq, B) threads; threadgroup (32 * ATTN_NSG, 1, 1).
//
// Each SIMD-group owns 8 query rows, keeps Q (pre-scaled by sm_scale * log2 e) and its output
// accumulator in float simdgroup matrices, and runs the online softmax on its own with SIMD
// shuffles. The only threadgroup barriers are the two around each K/V tile load.
constexpr int BQ = 8 * ATTN_NSG;
constexpr int NT = 32 * ATTN_NSG;
constexpr int PAD = 16 / int(sizeof(T));  // 16-byte row padding against bank conflicts
constexpr int LDK = BK + PAD;             // K tile stored transposed: kt_tile[d][key]
constexpr int LDV = D + PAD;              // V tile stored as is:      v_tile[key][d]
constexpr int DF = D / 8;
constexpr int KF = BK / 8;
static_assert(D % 8 == 0 && BK % 8 == 0, "D and BK must be multiples of 8");
static_assert(!KV_Q8 || D % QK8_0 == 0, "Q8_0 K/V needs D % 32 == 0");

threadgroup T kt_tile[D * LDK];
threadgroup T v_tile[BK * LDV];

const int Hq = q_shape[1];
const int Lq = q_shape[2];
const int Hkv = k_shape[1];
const int Lk = k_shape[2];
const int qblock = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int hk = h / (Hq / Hkv);  // GQA: Hq / Hkv query heads share one KV head
const int diag = Lk - Lq;        // query row i sees keys 0 .. i + diag

const uint lane = thread_index_in_simdgroup;
const int tid = int(thread_index_in_threadgroup);
const int row0 = qblock * BQ + 8 * int(simdgroup_index_in_threadgroup);
const int fr = attn_frag_row(lane);
const int fc = attn_frag_col(lane);
const int qrow = row0 + fr;
const bool sg_live = row0 < Lq;

// Keys any row of this threadgroup (of this SIMD-group) may see; later tiles are never loaded.
int kv_end = Lk;
int sg_kv_end = Lk;
if (CAUSAL) {
  kv_end = clamp(min(qblock * BQ + BQ, Lq) + diag, 0, Lk);
  sg_kv_end = clamp(min(row0 + 8, Lq) + diag, 0, Lk);
}
const int n_tiles = (kv_end + BK - 1) / BK;

const int64_t q_base = b * q_strides[0] + h * q_strides[1];
const int64_t k_base = b * k_strides[0] + hk * k_strides[1];
const int64_t v_base = b * v_strides[0] + hk * v_strides[1];
const int64_t ks_base = KV_Q8 ? b * k_scale_strides[0] + hk * k_scale_strides[1] : 0;
const int64_t vs_base = KV_Q8 ? b * v_scale_strides[0] + hk * v_scale_strides[1] : 0;

// Q fragments, scaled once in float so that scores come out in the log2 domain.
const float qk_scale = sm_scale[0] * ATTN_LOG2E;
attn_frag qf[DF];
attn_frag of[DF];
ATTN_UNROLL
for (int i = 0; i < DF; ++i) {
  float e0 = 0.0f;
  float e1 = 0.0f;
  if (qrow < Lq) {
    const int64_t o = q_base + qrow * q_strides[2] + (i * 8 + fc) * q_strides[3];
    e0 = float(q[o]) * qk_scale;
    e1 = float(q[o + q_strides[3]]) * qk_scale;
  }
  attn_set(qf[i], e0, e1);
  attn_set(of[i], 0.0f, 0.0f);
}

float m_run = ATTN_MASKED;  // running row max (log2 domain), finite from the start
float l_run = 0.0f;         // running row sum of exp2(s - m_run)

for (int t = 0; t < n_tiles; ++t) {
  const int kv0 = t * BK;

  // Stage keys kv0 .. kv0 + BK - 1 (zeros past Lk); consecutive threads read consecutive d.
  for (int i = tid; i < BK * D; i += NT) {
    const int kr = i / D;
    const int d = i % D;
    const int key = kv0 + kr;
    T kval = T(0.0f);
    T vval = T(0.0f);
    if (key < Lk) {
      const int64_t ko = k_base + key * k_strides[2] + d * k_strides[3];
      const int64_t vo = v_base + key * v_strides[2] + d * v_strides[3];
      if (KV_Q8) {
        const int64_t kso = ks_base + key * k_scale_strides[2] + (d / QK8_0) * k_scale_strides[3];
        const int64_t vso = vs_base + key * v_scale_strides[2] + (d / QK8_0) * v_scale_strides[3];
        kval = T(q8_0_dequantize(float(k[ko]), float(k_scale[kso])));
        vval = T(q8_0_dequantize(float(v[vo]), float(v_scale[vso])));
      } else {
        kval = T(k[ko]);
        vval = T(v[vo]);
      }
    }
    kt_tile[d * LDK + kr] = kval;
    v_tile[kr * LDV + d] = vval;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // A SIMD-group whose rows see no key of this tile skips it (uniform within the SIMD-group).
  if (sg_live && kv0 < sg_kv_end) {
    // S = (Q * scale * log2 e) K^T for this tile: 8 rows x BK keys, float.
    attn_frag sf[KF];
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      attn_set(sf[j], 0.0f, 0.0f);
      ATTN_UNROLL
      for (int i = 0; i < DF; ++i) {
        const int a = (i * 8 + fr) * LDK + j * 8 + fc;
        attn_frag kf;
        attn_set(kf, float(kt_tile[a]), float(kt_tile[a + 1]));
        simdgroup_multiply_accumulate(sf[j], qf[i], kf, sf[j]);
      }
    }

    // Mask keys past Lk and, when causal, above the diagonal; only tiles that need it.
    const bool need_mask = (kv0 + BK > Lk) || (CAUSAL && kv0 + BK - 1 > row0 + diag);
    float m_new = m_run;
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      ATTN_UNROLL
      for (int e = 0; e < 2; ++e) {
        float s = sf[j].thread_elements()[e];
        if (need_mask) {
          const int key = kv0 + j * 8 + fc + e;
          if (key >= Lk || (CAUSAL && key > qrow + diag)) {
            s = ATTN_MASKED;
            sf[j].thread_elements()[e] = s;
          }
        }
        m_new = max(m_new, s);
      }
    }
    m_new = attn_row_max(m_new);

    // Online softmax update in registers; a row with no visible key yet keeps p = 0.
    const bool row_live = m_new > ATTN_MASKED;
    float l_tile = 0.0f;
    ATTN_UNROLL
    for (int j = 0; j < KF; ++j) {
      ATTN_UNROLL
      for (int e = 0; e < 2; ++e) {
        const float p = row_live ? exp2(sf[j].thread_elements()[e] - m_new) : 0.0f;
        sf[j].thread_elements()[e] = p;
        l_tile += p;
      }
    }
    l_tile = attn_row_sum(l_tile);
    const float factor = exp2(m_run - m_new);
    l_run = l_run * factor + l_tile;
    m_run = m_new;

    // O = O * factor + P V.
    ATTN_UNROLL
    for (int i = 0; i < DF; ++i) {
      of[i].thread_elements()[0] *= factor;
      of[i].thread_elements()[1] *= factor;
      ATTN_UNROLL
      for (int j = 0; j < KF; ++j) {
        const int a = (j * 8 + fr) * LDV + i * 8 + fc;
        attn_frag vf;
        attn_set(vf, float(v_tile[a]), float(v_tile[a + 1]));
        simdgroup_multiply_accumulate(of[i], sf[j], vf, of[i]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// out[b, qrow, h, :] = O / l; a row that saw no key gives 0 instead of 0 / 0.
if (qrow < Lq) {
  const float inv_l = l_run > 0.0f ? 1.0f / l_run : 0.0f;
  const uint64_t row = (uint64_t(b) * uint64_t(Lq) + uint64_t(qrow)) * uint64_t(Hq) + uint64_t(h);
  const uint64_t o = row * D;
  ATTN_UNROLL
  for (int i = 0; i < DF; ++i) {
    out[o + i * 8 + fc] = T(of[i].thread_elements()[0] * inv_l);
    out[o + i * 8 + fc + 1] = T(of[i].thread_elements()[1] * inv_l);
  }
}
