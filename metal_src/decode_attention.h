// Helpers of the decode attention brick (decode_attention.metal, decode_attention_reduce.metal).
// Needs q8_0.h before it.
//
// Flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"):
// the KV length is split across threadgroups; each computes, for every query row it owns, a
// partial softmax over its keys (running max m, sum l, unnormalised output O, all float32), and
// one reduction kernel merges the splits. Tuning constants live here and in
// mlx_bricks/ops/decode.py, which sizes the grid from the same numbers.

// SIMD-groups per threadgroup of the split kernel. Each SIMD-group walks its own 32-key chunks
// of the split (chunk c goes to SIMD-group c % DEC_NSG), so the main loop has no threadgroup
// barrier at all.
#define DEC_NSG 4
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
#define DEC_MASKED (-3.4028234663852886e38f)
// log2(e): scores are kept in the log2 domain so the softmax uses exp2.
#define DEC_LOG2E 1.4426950408889634f
// Fixed-trip loops over rows and column slabs must unroll, or the arrays would leave registers.
#define DEC_UNROLL _Pragma("clang loop unroll(full)")

// Four consecutive elements (stride `stride`) of a K row as float. `P` is the pointer type, so
// the same helper reads device and constant buffers (MLX passes inputs of fewer than 8 elements
// as constant pointers) of any element type (half, bfloat, float, int8 Q8_0 quants).
template <typename P>
inline float4 dec_load4(P p, int64_t off, int64_t stride) {
  return float4(float(p[off]), float(p[off + stride]), float(p[off + 2 * stride]),
                float(p[off + 3 * stride]));
}
