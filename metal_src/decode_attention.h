// Helpers of the decode attention brick (decode_attention.metal, decode_attention_reduce.metal).
// Needs q8_0.h before it (QK8_0).
//
// Flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):
// the KV length is split across threadgroups; each computes, for every query row it owns, a
// partial softmax over its keys (running max m, sum l, unnormalised output O, all float32), and
// one reduction kernel merges the splits. Inside a threadgroup the lanes of a SIMD-group span
// head_dim, as in MLX's sdpa_vector: a SIMD-group reads one key row at a time (one coalesced
// row per load, 16-byte-or-less pieces per lane), its score is one simd_sum, and each lane
// keeps the output columns it read V for. Tuning constants live here and in
// mlx_bricks/ops/decode.py, which sizes the grid from the same numbers.

#ifndef MLX_BRICKS_DECODE_ATTENTION_H
#define MLX_BRICKS_DECODE_ATTENTION_H

#include <metal_stdlib>

using namespace metal;

// SIMD-groups per threadgroup of the split kernel: SIMD-group g takes keys g, g + DEC_NSG, ...
// of the split (DEC_NSG consecutive rows in flight), so the key loop has no barrier.
#define DEC_NSG 4
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
#define DEC_MASKED (-3.4028234663852886e38f)
// log2(e): scores are kept in the log2 domain so the softmax uses exp2.
#define DEC_LOG2E 1.4426950408889634f
// Fixed-trip loops over rows and columns must unroll, or the arrays would leave registers.
#define DEC_UNROLL _Pragma("clang loop unroll(full)")

// exp2 of the online softmax (argument <= 0). With a float16/bfloat16 output the fast variant's
// error (at most 3 + floor(2 |x|) float32 ulps) is far below the output's rounding; a float32
// output keeps the precise one. Explicit either way: MLX's math mode may be safe or fast.
template <typename T>
struct DecExp2 {
  static float eval(float x) { return fast::exp2(x); }
};
template <>
struct DecExp2<float> {
  static float eval(float x) { return precise::exp2(x); }
};

// N consecutive elements of E as one load, with only E's alignment (MLX binds a view at any
// element offset; gemm.h's DeviceVec128 makes the same choice, as MLX steel's ReadVector).
template <typename E, int N>
struct alignas(sizeof(E)) DecChunk {
  E v[N];
};

// Columns c0 .. c0 + N - 1 (those below D) of one row of k or v (elements of type E), as
// float. CONTIG: the d stride is 1, one chunk load (the tail lane of a head_dim that is not a
// multiple of 32 N reads element by element); otherwise scalar loads along the stride.
template <bool CONTIG, int N, int D, typename E, typename P>
inline void dec_load_row(thread float (&dst)[N], P row, int c0, int64_t d_stride) {
  if (CONTIG && (D % (32 * N) == 0 || c0 + N <= D)) {
    const DecChunk<E, N> c = *reinterpret_cast<const device DecChunk<E, N>*>(row + c0);
    DEC_UNROLL
    for (int j = 0; j < N; ++j) {
      dst[j] = float(c.v[j]);
    }
  } else {
    DEC_UNROLL
    for (int j = 0; j < N; ++j) {
      // lint-ok: strided-scalar-load the d-stride-1 path above takes chunk loads
      dst[j] = c0 + j < D ? float(row[(c0 + j) * (CONTIG ? 1 : d_stride)]) : 0.0f;
    }
  }
}

// Q8_0: the N values of a lane lie in one or two 32-value blocks; multiply each by its scale.
template <int N, typename SP>
inline void dec_scale_q8(thread float (&x)[N], SP scales, int c0, int64_t block_stride) {
  const int b0 = c0 / QK8_0;
  const float d0 = float(scales[b0 * block_stride]);
  const float d1 = (c0 + N - 1) / QK8_0 != b0 ? float(scales[(b0 + 1) * block_stride]) : d0;
  DEC_UNROLL
  for (int j = 0; j < N; ++j) {
    x[j] = q8_0_dequantize(x[j], (c0 + j) / QK8_0 == b0 ? d0 : d1);
  }
}

// Element type of k and v: the int8 quants with Q8_0, else T.
template <bool KV_Q8, typename T>
struct DecElem {
  typedef T type;
};
template <typename T>
struct DecElem<true, T> {
  typedef int8_t type;
};

// Where the keys of one (batch, KV head) live: element (key, d) of k at k[key * k_key + d * k_d]
// (qs for Q8_0, with the scale of block d / 32 at ks[key * ks_key + (d / 32) * ks_blk]).
template <typename KP, typename VP, typename KSP, typename VSP>
struct DecKV {
  KP k;
  VP v;
  KSP ks;
  VSP vs;
  int64_t k_key, k_d, v_key, v_d;
  int64_t ks_key, ks_blk, vs_key, vs_blk;
};

// A SIMD-group's running softmax over RT query rows: q (pre-scaled by scale * log2 e), m, l and
// the lane's N output columns of each row.
template <int RT, int N>
struct DecRows {
  float q[RT][N];
  float o[RT][N];
  float m[RT];
  float l[RT];
  int last_key[RT];  // last key each row may see (-1: a padding row past R)
};

// Keys k0, k0 + step, ... below k_end into st: per key one row of K and of V, RT simd_sums.
// The online softmax takes one exp2 per row and key: with d = s - m, a new maximum rescales by
// exp2(-d) and adds p = 1, otherwise the key adds p = exp2(d) (FlashAttention-2's update).
template <typename T, int D, int RT, int N, bool KV_Q8, bool CAUSAL, bool CONTIG, typename E,
          typename KV>
inline void dec_walk_keys(thread DecRows<RT, N>& st, thread const KV& kv, int k0, int k_end,
                          int step, int c0) {
  for (int key = k0; key < k_end; key += step) {
    float kf[N];
    float vf[N];
    dec_load_row<CONTIG, N, D, E>(kf, kv.k + key * kv.k_key, c0, kv.k_d);
    dec_load_row<CONTIG, N, D, E>(vf, kv.v + key * kv.v_key, c0, kv.v_d);
    if (KV_Q8) {
      dec_scale_q8<N>(kf, kv.ks + key * kv.ks_key, c0, kv.ks_blk);
      dec_scale_q8<N>(vf, kv.vs + key * kv.vs_key, c0, kv.vs_blk);
    }
    DEC_UNROLL
    for (int r = 0; r < RT; ++r) {
      float s = 0.0f;
      DEC_UNROLL
      for (int j = 0; j < N; ++j) {
        s += st.q[r][j] * kf[j];
      }
      s = simd_sum(s);
      if (CAUSAL ? key <= st.last_key[r] : st.last_key[r] >= 0) {
        const float d = s - st.m[r];  // uniform across the SIMD-group, as s and m are
        float factor = 1.0f;
        float p;
        if (d > 0.0f) {
          factor = DecExp2<T>::eval(-d);
          p = 1.0f;
          st.m[r] = s;
        } else {
          p = DecExp2<T>::eval(d);
        }
        st.l[r] = st.l[r] * factor + p;
        DEC_UNROLL
        for (int j = 0; j < N; ++j) {
          st.o[r][j] = st.o[r][j] * factor + p * vf[j];
        }
      }
    }
  }
}

#endif  // MLX_BRICKS_DECODE_ATTENTION_H
