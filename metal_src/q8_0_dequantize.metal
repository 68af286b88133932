// Q8_0 dequantization (ggml dequantize_row_q8_0, see q8_0.h): out = qs * d in float32, cast to T.
// One thread per element of qs in row-major order; qs and d may be strided views (cache slices):
// row-contiguous ones are indexed directly, others through 32-bit index arithmetic.
// Inputs: qs int8 (..., D), d half (..., D / 32). Output: out T (..., D), row-contiguous.
const uint elem = thread_position_in_grid.x;
const bool qs_flat = q8_0_contiguous(qs_shape, qs_strides, qs_ndim);
const bool d_flat = q8_0_contiguous(d_shape, d_strides, qs_ndim);
const float q = float(qs[qs_flat ? int64_t(elem)
                                 : q8_0_elem_offset(elem, qs_shape, qs_strides, qs_ndim, 1)]);
const float scale = float(d[d_flat ? int64_t(elem / QK8_0)
                                   : q8_0_elem_offset(elem, qs_shape, d_strides, qs_ndim, QK8_0)]);
out[elem] = T(q8_0_dequantize(q, scale));
