// Decode attention brick, reduction kernel: merges the splits of decode_attention.metal.
// Headers: q8_0.h, decode_attention.h.
//
// Template: T (output dtype), D (head_dim).
// Inputs (row-contiguous, as the split kernel writes them):
//   o_part (B, Hq, Lq, S, D) float: unnormalised output of each split
//   ml_part (B, Hq, Lq, S, 2) float: each split's row max m (log2 domain) and row sum l
// Output: out (B, Lq, Hq, D) T, every element written:
//   out = sum_s o_s * exp2(m_s - M) / sum_s l_s * exp2(m_s - M), M = max_s m_s;
//   0 for a row that saw no key (every l_s = 0), never 0 / 0.
// Grid: (32, Lq * Hq, B) threads, threadgroup (32, 1, 1): one SIMD-group per output row, lane
// owns columns lane + 32 i.
constexpr int NS = (D + 31) / 32;

const int Hq = o_part_shape[1];
const int Lq = o_part_shape[2];
const int S = o_part_shape[3];
const int qi = int(threadgroup_position_in_grid.y) / Hq;
const int h = int(threadgroup_position_in_grid.y) % Hq;
const int b = int(threadgroup_position_in_grid.z);
const int lane = int(thread_index_in_simdgroup);

const int64_t row = ((int64_t(b) * Hq + h) * Lq + qi) * S;
float m_all = DEC_MASKED;
for (int s = 0; s < S; ++s) {
  m_all = max(m_all, ml_part[(row + s) * 2]);
}
float l = 0.0f;
for (int s = 0; s < S; ++s) {
  l += ml_part[(row + s) * 2 + 1] * exp2(ml_part[(row + s) * 2] - m_all);
}
const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;

const int64_t orow = ((int64_t(b) * Lq + qi) * Hq + h) * D;
DEC_UNROLL
for (int i = 0; i < NS; ++i) {
  const int c = lane + 32 * i;
  if (c < D) {
    float o = 0.0f;
    for (int s = 0; s < S; ++s) {
      o += o_part[(row + s) * D + c] * exp2(ml_part[(row + s) * 2] - m_all);
    }
    out[orow + c] = T(o * inv_l);
  }
}
