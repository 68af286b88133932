// Helpers of the FlashAttention prefill brick (attention.metal). Needs q8_0.h and gemm.h
// (Vec128 / DeviceVec128 / Load128: the 128-bit loads of the shared ingestion pipeline) before it.
//
// The tile sizes are template parameters chosen in mlx_bricks/ops/attention.py
// (attention_tile_config), which also sizes the grid; the kernel static_asserts the
// threadgroup memory they imply against ATTN_TG_LIMIT.

#ifndef MLX_BRICKS_ATTENTION_H
#define MLX_BRICKS_ATTENTION_H

#include <metal_stdlib>
#include <metal_simdgroup_matrix>

using namespace metal;

// Threadgroup memory of one threadgroup must stay within this many bytes (Apple GPUs: 32 KB).
#define ATTN_TG_LIMIT 32768
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
#define ATTN_MASKED (-3.4028234663852886e38f)
// log2(e): p = exp2((s - m) * log2 e) computed as exp2(fma(s, log2 e, -m * log2 e)).
#define ATTN_LOG2E 1.4426950408889634f
// Fixed-trip loops over fragments must unroll, or the fragment arrays would leave registers.
#define ATTN_UNROLL _Pragma("clang loop unroll(full)")

typedef simdgroup_matrix<float, 8, 8> attn_frag;

// Row of the 8x8 fragment whose elements (row, col) and (row, col + 1) this lane holds
// (the Apple GPU simdgroup_matrix lane layout, as in MLX's steel kernels).
inline int attn_frag_row(uint lane) {
  const int qid = int(lane) / 4;
  return (qid & 4) + (int(lane) / 2) % 4;
}

// First of the two columns this lane holds.
inline int attn_frag_col(uint lane) {
  const int qid = int(lane) / 4;
  return (qid & 2) * 2 + (int(lane) % 2) * 2;
}

// Reductions over the four lanes that hold one fragment row: they differ in lane bits 0 and 3.
inline float attn_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(8)));
}

inline float attn_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

inline void attn_set(thread attn_frag& f, float e0, float e1) {
  f.thread_elements()[0] = e0;
  f.thread_elements()[1] = e1;
}

// exp2 of the softmax (argument <= 0). With a float16/bfloat16 output the fast variant's error
// (a few float32 ulps near 0) is far below the output's rounding, so it is used there; a
// float32 output keeps the precise one (MLX compiles in safe math mode, where plain exp2 is
// precise: the choice is explicit here either way).
template <typename T>
struct AttnExp2 {
  static float eval(float x) { return fast::exp2(x); }
};
template <>
struct AttnExp2<float> {
  static float eval(float x) { return precise::exp2(x); }
};

// ---------------------------------------------------------------------------------------------
// K/V ingestion: one (Lk, D) head of k or v -> a BK x D threadgroup tile (row pitch LD).
// A source's load(chunk, key, col) fills the 16-byte chunk of elements col .. col + VW - 1 of
// key `key` (VW = 16 / sizeof(T)); sources exist for plain T and for Q8_0 (dequantized on the
// way in, as gemm.h's TileLoader transforms A chunks).
// ---------------------------------------------------------------------------------------------

// k or v in T. vec: the d stride is 1 (and the row strides keep 16-byte steps): one 128-bit
// load per chunk through DeviceVec128 (element alignment only, as gemm.h); otherwise scalar
// loads along the d stride (mlx-lm's KV cache slices and transposed projections both take
// the 128-bit path; odd views fall back).
template <typename T, typename Ptr>
struct AttnPlainSource {
  Ptr base;            // element (key 0, d 0) of this (batch, KV head)
  int64_t key_stride;  // elements between consecutive keys
  int64_t d_stride;    // elements between consecutive d
  bool vec;

  void load(thread bricks::Vec128<T>& c, int key, int col) const {
    const Ptr row = base + key * key_stride;
    if (vec) {
      bricks::Load128<bricks::SameType<Ptr, const device T*>::value>::load(c, row + col);
    } else {
      ATTN_UNROLL
      for (short j = 0; j < short(16 / sizeof(T)); ++j) {
        c.v[j] = row[(col + j) * d_stride];  // lint-ok: strided-scalar-load the vec fallback
      }
    }
  }
};

// VW int8 quants read as one load (element alignment, as DeviceVec128).
template <short N>
struct AttnQuants {
  int8_t v[N];
};

// Q8_0 k or v: int8 quants qs (key, d) and one half scale per 32 d. A chunk (VW <= 8 values,
// VW divides 32) never crosses a block, so it reads one scale; q * d in float32, then T: the
// value dequantize_q8_0 gives. vec: the d stride is 1, the chunk's quants are one load.
template <typename T, typename QPtr, typename SPtr>
struct AttnQ8Source {
  QPtr qs;
  SPtr scales;
  int64_t key_stride;
  int64_t d_stride;
  int64_t scale_key_stride;
  int64_t scale_block_stride;
  bool vec;

  void load(thread bricks::Vec128<T>& c, int key, int col) const {
    constexpr short VW = short(16 / sizeof(T));
    const float d = float(scales[key * scale_key_stride + (col / QK8_0) * scale_block_stride]);
    const QPtr row = qs + key * key_stride;
    if (vec) {
      const AttnQuants<VW> q = *reinterpret_cast<const device AttnQuants<VW>*>(row + col);
      ATTN_UNROLL
      for (short j = 0; j < VW; ++j) {
        c.v[j] = T(q8_0_dequantize(float(q.v[j]), d));
      }
    } else {
      ATTN_UNROLL
      for (short j = 0; j < VW; ++j) {
        // lint-ok: strided-scalar-load the fallback of the vec path
        c.v[j] = T(q8_0_dequantize(float(row[(col + j) * d_stride]), d));
      }
    }
  }
};

// The source type of k or v: Q8_0 (qs, d) or plain T (SPtr: the scale array's pointer type).
template <bool Q8, typename T, typename Ptr, typename SPtr>
struct AttnSourceOf {
  typedef AttnPlainSource<T, Ptr> type;
};
template <typename T, typename Ptr, typename SPtr>
struct AttnSourceOf<true, T, Ptr, SPtr> {
  typedef AttnQ8Source<T, Ptr, SPtr> type;
};

// Stage keys kv0 .. kv0 + BK - 1 into tile[BK][LD] (zeros past Lk and below kv_lo, the
// batch row's first valid key: padding is never read, so NaN there cannot reach O through
// 0 * NaN). The tile is BK * D / VW
// chunks; thread tid takes chunks tid, tid + NT, ...: consecutive threads read consecutive
// 16-byte pieces of one key row. All loads of a thread are issued before its stores.
template <typename T, int D, int BK, int LD, int NT, typename Source>
inline void attn_stage_tile(threadgroup T* tile, thread const Source& src, int kv0, int kv_lo,
                            int Lk, int tid) {
  constexpr int VW = 16 / int(sizeof(T));
  constexpr int CPR = D / VW;  // chunks per key row
  constexpr int NCH = BK * CPR;
  constexpr int PER = (NCH + NT - 1) / NT;
  static_assert(D % VW == 0 && LD % VW == 0, "tile rows must be whole 16-byte chunks");
  bricks::Vec128<T> regs[PER];
  ATTN_UNROLL
  for (int i = 0; i < PER; ++i) {
    const int c = tid + i * NT;
    const int key = kv0 + c / CPR;
    if (c < NCH && key >= kv_lo && key < Lk) {
      src.load(regs[i], key, (c % CPR) * VW);
    } else {
      ATTN_UNROLL
      for (short j = 0; j < short(VW); ++j) regs[i].v[j] = T(0.0f);
    }
  }
  ATTN_UNROLL
  for (int i = 0; i < PER; ++i) {
    const int c = tid + i * NT;
    if (c < NCH) {
      threadgroup bricks::Vec128<T>* dst = reinterpret_cast<threadgroup bricks::Vec128<T>*>(
          tile + (c / CPR) * LD + (c % CPR) * VW);
      ATTN_UNROLL
      for (short j = 0; j < short(VW); ++j) dst->v[j] = regs[i].v[j];
    }
  }
}

#endif  // MLX_BRICKS_ATTENTION_H
