// Decode attention brick, split kernel (flash-decoding): the partial softmax of every query row of
// one KV head (GQA group x query positions) over one split of the keys. Headers: q8_0.h,
// decode_attention.h. The reduction kernel (decode_attention_reduce.metal) merges the splits.
//
// Template: T (dtype of q, and of k/v unless KV_Q8), D (head_dim, multiple of 16), RT (query
// rows per threadgroup, at most 8), KV_Q8 (k/v are Q8_0 quants with half scales), CAUSAL
// (bottom-right).
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
// a threadgroup holds RT of them, so each K/V row it reads serves all of them (GQA reuse).
// Lane l of every SIMD-group owns head_dim columns l * N .. l * N + N - 1 (N = ceil(D / 32)) of
// q, K, V and O; SIMD-group g walks keys g, g + DEC_NSG, ... of the split (dec_walk_keys), with
// one chunk load per lane and row when k and v have unit d stride (the usual KV cache) and
// strided scalar loads otherwise. At the end the DEC_NSG partial softmaxes are merged one row at
// a time through a DEC_NSG x D buffer.
constexpr int NT = 32 * DEC_NSG;
constexpr int N = (D + 31) / 32;  // columns per lane
static_assert(D % 16 == 0, "D must be a multiple of 16");
static_assert(RT >= 1 && RT <= 8, "RT must be 1 .. 8");
static_assert(!KV_Q8 || D % QK8_0 == 0, "Q8_0 K/V needs D % 32 == 0");

threadgroup float o_tg[DEC_NSG * D];        // one row of each SIMD-group's O
threadgroup float ml_tg[DEC_NSG * RT * 2];  // each SIMD-group's m and l of every row

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
const int c0 = lane * N;

// This threadgroup's keys; with CAUSAL none past what its last row may see.
const int k_begin = split * split_len[0];
int k_end = min(Lk, k_begin + split_len[0]);
if (CAUSAL) {
  k_end = min(k_end, (min(row0 + RT, R) - 1) / G + diag + 1);
}

// The lane's columns of every row's q, pre-scaled so that scores come out in the log2 domain
// (rows past R are zeros that see no key).
DecRows<RT, N> st;
const float qk_scale = sm_scale[0] * DEC_LOG2E;
DEC_UNROLL
for (int r = 0; r < RT; ++r) {
  const int gr = row0 + r;
  st.last_key[r] = gr >= R ? -1 : (CAUSAL ? gr / G + diag : Lk - 1);
  st.m[r] = DEC_MASKED;
  st.l[r] = 0.0f;
  const int64_t qo = b * q_strides[0] + (hk * G + gr % G) * q_strides[1] +
                     (gr / G) * q_strides[2];
  DEC_UNROLL
  for (int j = 0; j < N; ++j) {
    // lint-ok: strided-scalar-load q is read once per threadgroup
    st.q[r][j] = gr < R && c0 + j < D ? float(q[qo + (c0 + j) * q_strides[3]]) * qk_scale : 0.0f;
    st.o[r][j] = 0.0f;
  }
}

typedef typename DecElem<KV_Q8, T>::type KE;  // element type of k and v
DecKV<decltype(k + 0), decltype(v + 0), decltype(k_scale + 0), decltype(v_scale + 0)> kv;
kv.k = k + (b * k_strides[0] + hk * k_strides[1]);
kv.v = v + (b * v_strides[0] + hk * v_strides[1]);
kv.k_key = k_strides[2];
kv.k_d = k_strides[3];
kv.v_key = v_strides[2];
kv.v_d = v_strides[3];
kv.ks = k_scale + (KV_Q8 ? b * k_scale_strides[0] + hk * k_scale_strides[1] : 0);
kv.vs = v_scale + (KV_Q8 ? b * v_scale_strides[0] + hk * v_scale_strides[1] : 0);
kv.ks_key = KV_Q8 ? k_scale_strides[2] : 0;
kv.ks_blk = KV_Q8 ? k_scale_strides[3] : 0;
kv.vs_key = KV_Q8 ? v_scale_strides[2] : 0;
kv.vs_blk = KV_Q8 ? v_scale_strides[3] : 0;
if (kv.k_d == 1 && kv.v_d == 1) {
  dec_walk_keys<T, D, RT, N, KV_Q8, CAUSAL, true, KE>(st, kv, k_begin + sg, k_end, DEC_NSG, c0);
} else {
  dec_walk_keys<T, D, RT, N, KV_Q8, CAUSAL, false, KE>(st, kv, k_begin + sg, k_end, DEC_NSG, c0);
}

// Merge the SIMD-groups, row by row: O = sum_g O_g * exp2(m_g - M), l likewise, M = max_g m_g.
if (lane == 0) {
  DEC_UNROLL
  for (int r = 0; r < RT; ++r) {
    ml_tg[(sg * RT + r) * 2] = st.m[r];
    ml_tg[(sg * RT + r) * 2 + 1] = st.l[r];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
DEC_UNROLL
for (int r = 0; r < RT; ++r) {
  float m_all = DEC_MASKED;
  DEC_UNROLL
  for (int g = 0; g < DEC_NSG; ++g) {
    m_all = max(m_all, ml_tg[(g * RT + r) * 2]);
  }
  const float w = precise::exp2(st.m[r] - m_all);
  DEC_UNROLL
  for (int j = 0; j < N; ++j) {
    if (c0 + j < D) {
      o_tg[sg * D + c0 + j] = st.o[r][j] * w;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int gr = row0 + r;
  if (gr < R) {
    const int h = hk * G + gr % G;
    const int64_t row = ((int64_t(b) * Hq + h) * Lq + gr / G) * S + split;
    for (int c = tid; c < D; c += NT) {
      float o = 0.0f;
      DEC_UNROLL
      for (int g = 0; g < DEC_NSG; ++g) {
        o += o_tg[g * D + c];
      }
      o_part[row * D + c] = o;
    }
    if (tid == 0) {
      float l = 0.0f;
      DEC_UNROLL
      for (int g = 0; g < DEC_NSG; ++g) {
        l += ml_tg[(g * RT + r) * 2 + 1] * precise::exp2(ml_tg[(g * RT + r) * 2] - m_all);
      }
      ml_part[row * 2] = m_all;
      ml_part[row * 2 + 1] = l;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // o_tg is rewritten for the next row
}
