// Inverse RMS of every row of x, once per row, for the fused RMSNorm + QKV kernel:
// inv_rms[m] = rsqrt(mean(x[m, :]^2) + eps) in float32, as mx.fast.rms_norm (MLX 0.32)
// computes it (sum of squares in float, precise::rsqrt).
//
// Template: T (half, bfloat, float), VEC (K % (16 / sizeof(T)) == 0: 128-bit loads allowed).
// Inputs: x (..., K) with any strides (rows = flattened leading dims); eps (0-d float32).
// Output: inv_rms (M,) float32.
// Grid: (32 * M, 1, 1), threadgroup (min(128, 32 * M), 1, 1): one simdgroup per row.

const int n_lead = x_ndim - 1;
const int K = x_shape[n_lead];
const int m = int(thread_position_in_grid.x / 32);
const ushort lane = ushort(thread_index_in_simdgroup);

// 128-bit loads need unit stride along K and 16-byte aligned row starts.
bool x_vec = VEC && x_strides[n_lead] == 1;
for (int d = 0; d < n_lead; ++d) {
  if (x_shape[d] > 1 && x_strides[d] % (16 / sizeof(T)) != 0) x_vec = false;
}
const float sum = bricks::row_sum_squares<T>(
    x + bricks::strided_row_offset(m, x_shape, x_strides, n_lead), K, x_strides[n_lead], x_vec,
    lane);
if (lane == 0) inv_rms[m] = metal::precise::rsqrt(sum / float(K) + eps);
