// Decode attention brick, reduction kernel: CUDA twin of metal_src/decode_attention_reduce.metal
// (same inputs, outputs, template arguments and launch geometry). Header: mma.cuh.
//
// Template: T (output dtype), D (head_dim). Inputs (row-contiguous): o_part (B, Hq, Lq, S, D)
// float, ml_part (B, Hq, Lq, S, 2) float. Output: out (B, Lq, Hq, D) T:
// out = sum_s o_s exp2(m_s - M) / sum_s l_s exp2(m_s - M), M = max_s m_s; 0 when every l_s = 0.
// Launch: grid (32, Lq * Hq, B) threads, block 32: one warp per output row, lane owns columns
// lane + 32 i (coalesced reads of each split's partial row).
constexpr int NS = (D + 31) / 32;
constexpr float MASKED = -3.4028234663852886e38f;

const int Hq = o_part_shape[1];
const int Lq = o_part_shape[2];
const int S = o_part_shape[3];
const int qi = int(blockIdx.y) / Hq;
const int h = int(blockIdx.y) % Hq;
const int b = int(blockIdx.z);
const int lane = int(threadIdx.x);

const int64_t row = ((int64_t(b) * Hq + h) * Lq + qi) * S;
float m_all = MASKED;
for (int s = 0; s < S; ++s) {
  m_all = fmaxf(m_all, ml_part[(row + s) * 2]);
}
float l = 0.0f;
for (int s = 0; s < S; ++s) {
  l += ml_part[(row + s) * 2 + 1] * exp2f(ml_part[(row + s) * 2] - m_all);
}
const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;

const int64_t orow = ((int64_t(b) * Lq + qi) * Hq + h) * D;
#pragma unroll
for (int i = 0; i < NS; ++i) {
  const int c = lane + 32 * i;
  if (c < D) {
    float o = 0.0f;
    for (int s = 0; s < S; ++s) {
      o += o_part[(row + s) * D + c] * exp2f(ml_part[(row + s) * 2] - m_all);
    }
    out[orow + c] = bricks::from_float<T>(o * inv_l);
  }
}
