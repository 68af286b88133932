// Decode attention brick, split kernel (flash-decoding): the partial softmax of every query row of
// one KV head (GQA group x query positions) over one split of the keys. Headers: q8_0.h,
// decode_attention.h. The reduction kernel (decode_attention_reduce.metal) merges the splits.
//
// Template: T (dtype of q, and of k/v unless KV_Q8), D (head_dim, multiple of 16), RT (query
// rows per threadgroup), KV_Q8 (k/v are Q8_0 quants with half scales), CAUSAL (bottom-right).
// Inputs (any strides):
//   q (B, Hq, Lq, D) T
//   k, v (B, Hkv, Lk, D): T, or int8 quants when KV_Q8
//   k_scale, v_scale (B, Hkv, Lk, D / 32) half Q8_0 scales when KV_Q8, else (1, 1, 1, 1) dummies
//   split_len (1,) int: keys per split (split s covers keys s * split_len .. + split_len - 1)
//   sm_scale (1,) float: multiplier of q . k
// Outputs, every element written:
//   o_part (B, Hq, Lq, S, D) float: unnormalised output of each split (S splits)
//   ml_part (B, Hq, Lq, S, 2) float: each split's row max m (log2 domain) and row sum l
// Grid: (32 * DEC_NSG * S, Hkv * n_tiles, B) threads, threadgroup (32 * DEC_NSG, 1, 1), with
// n_tiles = ceil(R / RT) and R = (Hq / Hkv) * Lq query rows per KV head.
//
// Row gr of a KV head hk is query position gr / G of query head hk * G + gr % G (G = Hq / Hkv):
// a threadgroup holds RT of them, so each K/V element it reads serves all of them (GQA reuse).
// Each SIMD-group walks 32-key chunks of the split; in a chunk lane j owns key j for the scores
// (a whole q . k per lane: no reduction across lanes) and columns lane + 32 i of the output for
// P V. Per chunk and row: one simd_max, one simd_sum, and the chunk's probabilities pass
// through threadgroup memory (p_tg) from the key lanes to the column lanes.
constexpr int NT = 32 * DEC_NSG;
constexpr int NS = (D + 31) / 32;  // column slabs per lane: lane owns columns lane + 32 * i
constexpr int D4 = D / 4;
static_assert(D % 16 == 0, "D must be a multiple of 16");
static_assert(!KV_Q8 || D % QK8_0 == 0, "Q8_0 K/V needs D % 32 == 0");

threadgroup float4 q_tg[RT * D4];           // q rows * sm_scale * log2(e)
threadgroup float p_tg[DEC_NSG * RT * 32];  // each SIMD-group's probabilities of its chunk
threadgroup float o_tg[DEC_NSG * RT * D];   // each SIMD-group's O, merged at the end
threadgroup float m_tg[DEC_NSG * RT];
threadgroup float l_tg[DEC_NSG * RT];

const int Hq = q_shape[1];
const int Lq = q_shape[2];
const int Hkv = k_shape[1];
const int Lk = k_shape[2];
const int G = Hq / Hkv;
const int R = G * Lq;
const int n_tiles = (R + RT - 1) / RT;
const int split = int(threadgroup_position_in_grid.x);
const int S = int(threadgroups_per_grid.x);
const int hk = int(threadgroup_position_in_grid.y) / n_tiles;
const int row0 = (int(threadgroup_position_in_grid.y) % n_tiles) * RT;
const int b = int(threadgroup_position_in_grid.z);
const int diag = Lk - Lq;  // CAUSAL: query position qi sees keys 0 .. qi + diag
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int tid = int(thread_index_in_threadgroup);

// This threadgroup's keys; with CAUSAL none past what its last row may see.
const int k_begin = split * split_len[0];
int k_end = min(Lk, k_begin + split_len[0]);
if (CAUSAL) {
  k_end = min(k_end, (min(row0 + RT, R) - 1) / G + diag + 1);
}

// Stage q, pre-scaled so that scores come out in the log2 domain; rows past R are zeros.
const float qk_scale = sm_scale[0] * DEC_LOG2E;
for (int i = tid; i < RT * D4; i += NT) {
  const int gr = row0 + i / D4;
  const int d = (i % D4) * 4;
  float4 val = float4(0.0f);
  if (gr < R) {
    const int64_t o = b * q_strides[0] + (hk * G + gr % G) * q_strides[1] +
                      (gr / G) * q_strides[2] + d * q_strides[3];
    val = dec_load4(q, o, q_strides[3]) * qk_scale;
  }
  q_tg[i] = val;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

int last_key[RT];  // last key each row may see
float m_run[RT];   // running row max (log2 domain), finite from the start
float l_run[RT];   // running row sum of exp2(s - m_run)
float acc[RT][NS]; // unnormalised output, columns lane + 32 i
DEC_UNROLL
for (int r = 0; r < RT; ++r) {
  last_key[r] = CAUSAL ? (row0 + r) / G + diag : Lk - 1;
  m_run[r] = DEC_MASKED;
  l_run[r] = 0.0f;
  DEC_UNROLL
  for (int i = 0; i < NS; ++i) {
    acc[r][i] = 0.0f;
  }
}

const int64_t k_base = b * k_strides[0] + hk * k_strides[1];
const int64_t v_base = b * v_strides[0] + hk * v_strides[1];
const int64_t ks_base = KV_Q8 ? b * k_scale_strides[0] + hk * k_scale_strides[1] : 0;
const int64_t vs_base = KV_Q8 ? b * v_scale_strides[0] + hk * v_scale_strides[1] : 0;
threadgroup float* p_sg = p_tg + sg * RT * 32;

for (int c0 = k_begin + sg * 32; c0 < k_end; c0 += NT) {
  // Scores: lane j computes q . k of key c0 + j for every row (q from threadgroup memory).
  const int key = c0 + lane;
  const bool key_ok = key < k_end;
  float s[RT];
  DEC_UNROLL
  for (int r = 0; r < RT; ++r) {
    s[r] = 0.0f;
  }
  if (key_ok) {
    const int64_t ko = k_base + key * k_strides[2];
    if (KV_Q8) {
      // Q8_0: q . (qs * d) summed per 32-value block, then times the block's scale d.
      const int64_t kso = ks_base + key * k_scale_strides[2];
      for (int blk = 0; blk < D / QK8_0; ++blk) {
        float part[RT];
        DEC_UNROLL
        for (int r = 0; r < RT; ++r) {
          part[r] = 0.0f;
        }
        DEC_UNROLL
        for (int e = 0; e < QK8_0; e += 4) {
          const int d = blk * QK8_0 + e;
          const float4 kq = dec_load4(k, ko + d * k_strides[3], k_strides[3]);
          DEC_UNROLL
          for (int r = 0; r < RT; ++r) {
            part[r] += dot(q_tg[r * D4 + d / 4], kq);
          }
        }
        const float kd = float(k_scale[kso + blk * k_scale_strides[3]]);
        DEC_UNROLL
        for (int r = 0; r < RT; ++r) {
          s[r] += kd * part[r];
        }
      }
    } else {
      for (int d = 0; d < D; d += 4) {
        const float4 kv = dec_load4(k, ko + d * k_strides[3], k_strides[3]);
        DEC_UNROLL
        for (int r = 0; r < RT; ++r) {
          s[r] += dot(q_tg[r * D4 + d / 4], kv);
        }
      }
    }
  }

  // Online softmax update of every row over this chunk (FlashAttention-2's rescaling).
  DEC_UNROLL
  for (int r = 0; r < RT; ++r) {
    const bool visible = key_ok && key <= last_key[r];
    const float m_new = max(m_run[r], simd_max(visible ? s[r] : DEC_MASKED));
    const float p = visible ? exp2(s[r] - m_new) : 0.0f;
    const float factor = exp2(m_run[r] - m_new);
    l_run[r] = l_run[r] * factor + simd_sum(p);
    m_run[r] = m_new;
    DEC_UNROLL
    for (int i = 0; i < NS; ++i) {
      acc[r][i] *= factor;
    }
    p_sg[r * 32 + lane] = p;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  // O += P V: lane owns columns lane + 32 i, keys in order; V rows are read coalesced.
  const int n_keys = min(32, k_end - c0);
  for (int j = 0; j < n_keys; ++j) {
    const int64_t vo = v_base + (c0 + j) * v_strides[2];
    const int64_t vso = vs_base + (c0 + j) * (KV_Q8 ? v_scale_strides[2] : 0);
    float pj[RT];
    DEC_UNROLL
    for (int r = 0; r < RT; ++r) {
      pj[r] = p_sg[r * 32 + j];
    }
    DEC_UNROLL
    for (int i = 0; i < NS; ++i) {
      const int c = lane + 32 * i;
      if (c < D) {
        float vv = float(v[vo + c * v_strides[3]]);
        if (KV_Q8) {
          vv = q8_0_dequantize(vv, float(v_scale[vso + i * v_scale_strides[3]]));
        }
        DEC_UNROLL
        for (int r = 0; r < RT; ++r) {
          acc[r][i] += pj[r] * vv;
        }
      }
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // p_sg is rewritten by the next chunk
}

// Merge the SIMD-groups: O = sum_g O_g * exp2(m_g - M), l likewise, M = max_g m_g.
DEC_UNROLL
for (int r = 0; r < RT; ++r) {
  if (lane == 0) {
    m_tg[sg * RT + r] = m_run[r];
    l_tg[sg * RT + r] = l_run[r];
  }
  DEC_UNROLL
  for (int i = 0; i < NS; ++i) {
    const int c = lane + 32 * i;
    if (c < D) {
      o_tg[(sg * RT + r) * D + c] = acc[r][i];
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int i = tid; i < RT * D; i += NT) {
  const int r = i / D;
  const int d = i % D;
  const int gr = row0 + r;
  if (gr < R) {
    float m_all = DEC_MASKED;
    for (int g = 0; g < DEC_NSG; ++g) {
      m_all = max(m_all, m_tg[g * RT + r]);
    }
    float o = 0.0f;
    float l = 0.0f;
    for (int g = 0; g < DEC_NSG; ++g) {
      const float w = exp2(m_tg[g * RT + r] - m_all);
      o += o_tg[(g * RT + r) * D + d] * w;
      l += l_tg[g * RT + r] * w;
    }
    const int h = hk * G + gr % G;
    const int64_t row = ((int64_t(b) * Hq + h) * Lq + gr / G) * S + split;
    o_part[row * D + d] = o;
    if (d == 0) {
      ml_part[row * 2] = m_all;
      ml_part[row * 2 + 1] = l;
    }
  }
}
