// The dequantize brick (dequantize.h): MLX affine weights to float, as mx.dequantize computes
// them. Template: T (the scales' and biases' dtype: the arithmetic's), O (the output dtype),
// BITS (2, 3, 4, 5, 6, 8), GROUP_SIZE (32, 64, 128), FUSED (one rounding instead of two).
// Inputs: w uint32 (N, K * BITS / 32), scales and biases (N, K / GROUP_SIZE) of T, all
// row-contiguous (ensure_row_contiguous). Output: out (N, K) of O, every element written.
// Launch: 1-D grid of ceil(N K / VALUES) threads, VALUES = bricks_dq::Run<BITS>::VALUES
// (mlx_bricks/bricks/dequantize/msl.py), any threadgroup size.
const ulong total = ulong(w_shape[0]) * ulong(w_shape[1]) * 32 / BITS;
const ulong base = ulong(thread_position_in_grid.x) * bricks_dq::Run<BITS>::VALUES;
if (base < total) {
  bricks_dq::dequantize_run<T, O, BITS, GROUP_SIZE, FUSED>(w, scales, biases, out, base, total);
}
