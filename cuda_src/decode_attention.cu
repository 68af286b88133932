// Decode attention brick, split kernel: CUDA twin of metal_src/decode_attention.metal (same
// inputs, outputs, template arguments and launch geometry; see that file for the algorithm).
// Header: mma.cuh.
//
// Template: T (dtype of q), D (head_dim, multiple of 16), RT (query rows per block), KV_Q8,
// CAUSAL. Inputs (any strides): q (B, Hq, Lq, D) T; k, v (B, Hkv, Lk, D) T or int8 quants;
// k_scale, v_scale (B, Hkv, Lk, D / 32) half (dummies without KV_Q8); split_len (1,) int32;
// sm_scale (1,) float. Outputs: o_part (B, Hq, Lq, S, D) float, ml_part (B, Hq, Lq, S, 2) float.
// Launch: grid (128 * S, Hkv * n_tiles, B) threads, block 128: blocks (S, Hkv * n_tiles, B).
//
// Memory-bound by design: each block serves every query row of its KV head (GQA reuse), K rows
// are read one per lane with 128-bit loads (16 int8 / 8 half / 4 float), int8 is converted with
// integer + FADD instructions (bricks::i8x4_to_float4), V columns are owned CV = 4 (or 2) at a
// time per lane so a lane's V load is one 32/64/128-bit word. Scalar loads through the strides
// take over when a view is not aligned for the vector path (checked once per block).
constexpr int NSG = 4;    // warps per block (DEC_NSG of the MSL)
constexpr int NT = 32 * NSG;
constexpr int D4 = D / 4;
constexpr int KE = 16 / int(sizeof(k[0]));  // K elements per 128-bit load
constexpr int CV = (D % 128 == 0) ? 4 : ((D % 64 == 0) ? 2 : 1);  // V columns per lane group
constexpr int NG = (D + 32 * CV - 1) / (32 * CV);  // column groups per lane
constexpr float MASKED = -3.4028234663852886e38f;
constexpr float LOG2E = 1.4426950408889634f;
static_assert(D % 16 == 0, "D must be a multiple of 16");
static_assert(!KV_Q8 || D % 32 == 0, "Q8_0 K/V needs D % 32 == 0");

__shared__ float4 q_tg[RT * D4];           // q rows * sm_scale * log2(e)
__shared__ float p_tg[NSG * RT * 32];      // each warp's probabilities of its chunk
__shared__ float o_tg[NSG * RT * D];       // each warp's O, merged at the end
__shared__ float m_tg[NSG * RT];
__shared__ float l_tg[NSG * RT];

const int Hq = q_shape[1];
const int Lq = q_shape[2];
const int Hkv = k_shape[1];
const int Lk = k_shape[2];
const int G = Hq / Hkv;
const int R = G * Lq;
const int n_tiles = (R + RT - 1) / RT;
const int split = int(blockIdx.x);
const int S = int(gridDim.x);
const int hk = int(blockIdx.y) / n_tiles;
const int row0 = (int(blockIdx.y) % n_tiles) * RT;
const int b = int(blockIdx.z);
const int diag = Lk - Lq;
const int tid = int(threadIdx.x);
const int sg = tid / 32;
const int lane = tid % 32;

const int k_begin = split * split_len[0];
int k_end = min(Lk, k_begin + split_len[0]);
if (CAUSAL) {
  k_end = min(k_end, (min(row0 + RT, R) - 1) / G + diag + 1);
}

const float qk_scale = sm_scale[0] * LOG2E;
for (int i = tid; i < RT * D4; i += NT) {
  const int gr = row0 + i / D4;
  const int d = (i % D4) * 4;
  float4 val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (gr < R) {
    const int64_t o = b * q_strides[0] + (hk * G + gr % G) * q_strides[1] +
                      (gr / G) * q_strides[2] + d * q_strides[3];
    const int64_t st = q_strides[3];
    val.x = bricks::to_float(q[o]) * qk_scale;
    val.y = bricks::to_float(q[o + st]) * qk_scale;
    val.z = bricks::to_float(q[o + 2 * st]) * qk_scale;
    val.w = bricks::to_float(q[o + 3 * st]) * qk_scale;
  }
  q_tg[i] = val;
}
__syncthreads();

int last_key[RT];
float m_run[RT];
float l_run[RT];
float acc[RT][NG][CV];
#pragma unroll
for (int r = 0; r < RT; ++r) {
  last_key[r] = CAUSAL ? (row0 + r) / G + diag : Lk - 1;
  m_run[r] = MASKED;
  l_run[r] = 0.0f;
#pragma unroll
  for (int i = 0; i < NG; ++i) {
#pragma unroll
    for (int e = 0; e < CV; ++e) {
      acc[r][i][e] = 0.0f;
    }
  }
}

const int64_t k_base = b * k_strides[0] + hk * k_strides[1];
const int64_t v_base = b * v_strides[0] + hk * v_strides[1];
const int64_t ks_base = KV_Q8 ? b * k_scale_strides[0] + hk * k_scale_strides[1] : 0;
const int64_t vs_base = KV_Q8 ? b * v_scale_strides[0] + hk * v_scale_strides[1] : 0;
// 128-bit K loads need every row start 16-byte aligned; CV-wide V loads likewise CV elements.
const int64_t ksz = int64_t(sizeof(k[0]));
const int64_t vsz = int64_t(sizeof(v[0]));
const bool k_vec = k_strides[3] == 1 && (k_strides[2] * ksz) % 16 == 0 &&
                   ((reinterpret_cast<uintptr_t>(k) + k_base * ksz) % 16) == 0;
const bool v_vec = CV > 1 && v_strides[3] == 1 && (v_strides[2] * vsz) % (CV * vsz) == 0 &&
                   ((reinterpret_cast<uintptr_t>(v) + v_base * vsz) % (CV * vsz)) == 0;
float* p_sg = p_tg + sg * RT * 32;

for (int c0 = k_begin + sg * 32; c0 < k_end; c0 += NT) {
  // Scores: lane j computes q . k of key c0 + j for every row.
  const int key = c0 + lane;
  const bool key_ok = key < k_end;
  float s[RT];
  float part[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    s[r] = 0.0f;
    part[r] = 0.0f;
  }
  if (key_ok) {
    const int64_t ko = k_base + key * k_strides[2];
    const int64_t kso = ks_base + key * (KV_Q8 ? k_scale_strides[2] : 0);
#pragma unroll
    for (int d0 = 0; d0 < D; d0 += KE) {
      float kf[KE];
      if (k_vec) {
        bricks::ldg16_as_float(k + ko + d0, kf);
      } else {
#pragma unroll
        for (int e = 0; e < KE; ++e) {
          kf[e] = bricks::to_float(k[ko + (d0 + e) * k_strides[3]]);
        }
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float a = 0.0f;
#pragma unroll
        for (int e = 0; e < KE; e += 4) {
          const float4 qv = q_tg[r * D4 + (d0 + e) / 4];
          a = fmaf(qv.x, kf[e], a);
          a = fmaf(qv.y, kf[e + 1], a);
          a = fmaf(qv.z, kf[e + 2], a);
          a = fmaf(qv.w, kf[e + 3], a);
        }
        part[r] += a;
      }
      // Q8_0: a block's q . qs times its scale d (a block is 2 loads of 16 quants).
      if (KV_Q8 && (d0 + KE) % 32 == 0) {
        const float kd = __half2float(k_scale[kso + (d0 / 32) * k_scale_strides[3]]);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          s[r] = fmaf(kd, part[r], s[r]);
          part[r] = 0.0f;
        }
      }
    }
    if (!KV_Q8) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        s[r] = part[r];
      }
    }
  }

  // Online softmax update of every row over this chunk.
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const bool visible = key_ok && key <= last_key[r];
    const float m_new = fmaxf(m_run[r], bricks::warp_max(visible ? s[r] : MASKED));
    const float p = visible ? exp2f(s[r] - m_new) : 0.0f;
    const float factor = exp2f(m_run[r] - m_new);
    l_run[r] = l_run[r] * factor + bricks::warp_sum(p);
    m_run[r] = m_new;
#pragma unroll
    for (int i = 0; i < NG; ++i) {
#pragma unroll
      for (int e = 0; e < CV; ++e) {
        acc[r][i][e] *= factor;
      }
    }
    p_sg[r * 32 + lane] = p;
  }
  __syncwarp();

  // O += P V: lane owns columns (32 i + lane) * CV .. + CV - 1.
  const int n_keys = min(32, k_end - c0);
  for (int j = 0; j < n_keys; ++j) {
    const int64_t vo = v_base + (c0 + j) * v_strides[2];
    const int64_t vso = vs_base + (c0 + j) * (KV_Q8 ? v_scale_strides[2] : 0);
    float pj[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      pj[r] = p_sg[r * 32 + j];
    }
#pragma unroll
    for (int i = 0; i < NG; ++i) {
      const int c = (32 * i + lane) * CV;
      if (c < D) {
        float vv[CV];
        if (v_vec) {
          bricks::ld_as_float<CV>(v + vo + c, vv);
        } else {
#pragma unroll
          for (int e = 0; e < CV; ++e) {
            vv[e] = bricks::to_float(v[vo + (c + e) * v_strides[3]]);
          }
        }
        if (KV_Q8) {
          // A lane's CV columns never cross a 32-column block (CV divides 32).
          const float vd = __half2float(v_scale[vso + (c / 32) * v_scale_strides[3]]);
#pragma unroll
          for (int e = 0; e < CV; ++e) {
            vv[e] *= vd;
          }
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
          for (int e = 0; e < CV; ++e) {
            acc[r][i][e] = fmaf(pj[r], vv[e], acc[r][i][e]);
          }
        }
      }
    }
  }
  __syncwarp();  // p_sg is rewritten by the next chunk
}

// Merge the warps: O = sum_g O_g * exp2(m_g - M), l likewise, M = max_g m_g.
#pragma unroll
for (int r = 0; r < RT; ++r) {
  if (lane == 0) {
    m_tg[sg * RT + r] = m_run[r];
    l_tg[sg * RT + r] = l_run[r];
  }
#pragma unroll
  for (int i = 0; i < NG; ++i) {
    const int c = (32 * i + lane) * CV;
    if (c < D) {
#pragma unroll
      for (int e = 0; e < CV; ++e) {
        o_tg[(sg * RT + r) * D + c + e] = acc[r][i][e];
      }
    }
  }
}
__syncthreads();

for (int i = tid; i < RT * D; i += NT) {
  const int r = i / D;
  const int d = i % D;
  const int gr = row0 + r;
  if (gr < R) {
    float m_all = MASKED;
#pragma unroll
    for (int g = 0; g < NSG; ++g) {
      m_all = fmaxf(m_all, m_tg[g * RT + r]);
    }
    float o = 0.0f;
    float l = 0.0f;
#pragma unroll
    for (int g = 0; g < NSG; ++g) {
      const float w = exp2f(m_tg[g * RT + r] - m_all);
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
