// Helpers of the FlashAttention prefill brick (attention.metal). Needs q8_0.h before it.
//
// Tuning constants live here and in mlx_bricks/ops/attention.py (which must agree: it sizes the
// grid and checks the threadgroup memory from the same numbers).

#include <metal_simdgroup_matrix>

// SIMD-groups per threadgroup; each owns 8 query rows, so a threadgroup covers 8 * ATTN_NSG rows.
#define ATTN_NSG 4
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
#define ATTN_MASKED (-3.4028234663852886e38f)
// log2(e): scores are kept in the log2 domain so the softmax uses exp2.
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
