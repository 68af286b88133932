// Q8_0 quantization (ggml quantize_row_q8_0_ref, see q8_0.h) of x (..., D), D % 32 == 0.
// One thread per element in row-major order; the threadgroup size is a multiple of 32, so each
// SIMD-group holds exactly one 32-value block and amax is one simd_max (no threadgroup memory).
// Inputs: x (any float dtype, any strides). Outputs: qs int8 (..., D), d half (..., D / 32).
const uint elem = thread_position_in_grid.x;
const bool contiguous = q8_0_contiguous(x_shape, x_strides, x_ndim);
const float xv = float(x[contiguous ? int64_t(elem)
                                    : q8_0_elem_offset(elem, x_shape, x_strides, x_ndim, 1)]);
// NaN counts as 0 in amax (one rule on every GPU; ggml drops NaN unless last in the block).
const float amax = simd_max(isnan(xv) ? 0.0f : fabs(xv));
const float scale = q8_0_scale(amax);
qs[elem] = q8_0_quantize(xv, q8_0_inverse_scale(scale));
if (thread_index_in_simdgroup == 0) {
  d[elem / QK8_0] = half(scale);
}
