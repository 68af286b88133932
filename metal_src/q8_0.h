// Q8_0: ggml's block format for K/V (and weights), shared by the Q8_0 kernels and attention.
//
// ggml packs a block as `block_q8_0` below: one half scale d and 32 int8 quants, 34 bytes per
// 32 values. mlx-bricks keeps the two fields in separate MLX arrays instead, qs int8 (..., D)
// and d float16 (..., D / 32), so that each can be sliced and strided like any KV cache array;
// the values and the arithmetic are ggml's (quantize_row_q8_0_ref / dequantize_row_q8_0):
//   amax = max |x| over the block (float32)
//   d    = amax / 127 (float32, correctly rounded), stored as half (round to nearest even)
//   id   = d != 0 ? 1 / d : 0 (correctly rounded), from the float32 d (not from the stored half)
//   q    = roundf(x * id): nearest integer, halves away from zero; |x * id| <= 127.0x so a
//          value at +-amax gives +-127, never -128
//   x'   = q * d, in float32
// The divisions are precise::divide: MLX may compile a kernel in fast math (2.5 ulp divisions),
// ggml pins its own Metal kernels to safe math for the same reason.
// One guard where ggml has none: a block whose d would round to an infinite half (amax above
// 127 x 65520, about 8.32e6) stores the largest half, 65504, and quantizes with it, so its
// quants saturate at +-127 and it dequantizes to at most +-8.32e6 instead of inf or NaN.

#ifndef MLX_BRICKS_Q8_0_H
#define MLX_BRICKS_Q8_0_H

#include <metal_stdlib>

using namespace metal;

#define QK8_0 32
// The largest finite half, and the smallest float32 that rounds to an infinite half.
#define Q8_0_D_MAX 65504.0f
#define Q8_0_D_INF 65520.0f

struct block_q8_0 {
  half d;            // scale: amax / 127
  int8_t qs[QK8_0];  // quants
};

// The float32 scale d of a block whose largest magnitude is amax, guarded so that half(d) is
// finite (see the top of this file).
inline float q8_0_scale(float amax) {
  const float d = precise::divide(amax, 127.0f);
  return d >= Q8_0_D_INF ? Q8_0_D_MAX : d;
}

// The float32 inverse scale ggml multiplies by: 0 for an all-zero block (so q = 0, not NaN).
inline float q8_0_inverse_scale(float d) {
  return d != 0.0f ? precise::divide(1.0f, d) : 0.0f;
}

// roundf(x * id) as an int8. Written with trunc so it does not depend on how a math library
// rounds halves. Where ggml's conversion is undefined (x * id not finite: NaN input, or id = inf
// when d is a float32 subnormal) the result is defined: NaN -> 0, +-inf -> +-127.
inline int8_t q8_0_quantize(float x, float id) {
  const float v = x * id;
  if (isnan(v)) {
    return 0;
  }
  const float t = trunc(v);
  float r = t + ((fabs(v - t) >= 0.5f) ? copysign(1.0f, v) : 0.0f);
  r = clamp(r, -127.0f, 127.0f);
  return int8_t(r);
}

// Dequantized value q * d in float32 (exact: an 8-bit times an 11-bit significand).
inline float q8_0_dequantize(float q, float d) {
  return q * d;
}

// Whether an array is row-contiguous (size-1 axes may have any stride): then flat element
// `elem` is at offset elem, and no per-element index arithmetic is needed.
template <typename ShapeP, typename StridesP>
inline bool q8_0_contiguous(ShapeP shape, StridesP strides, int ndim) {
  int64_t expected = 1;
  for (int a = ndim - 1; a >= 0; --a) {
    if (shape[a] != 1 && strides[a] != expected) {
      return false;
    }
    expected *= shape[a];
  }
  return true;
}

// Memory offset of flat (row-major) element `elem` of a strided array with the given shape.
// `last_div` divides the index along the last axis first: 32 maps an element of qs to its
// block's scale in d (same leading indices, last index / 32). 32-bit index arithmetic: the
// grid, and so elem, is below 2^32 (64-bit division is emulated on Apple GPUs).
template <typename ShapeP, typename StridesP>
inline int64_t q8_0_elem_offset(uint elem, ShapeP shape, StridesP strides, int ndim,
                                uint last_div) {
  int64_t off = 0;
  for (int a = ndim - 1; a >= 0; --a) {
    const uint n = uint(shape[a]);
    uint idx = elem % n;
    elem /= n;
    if (a == ndim - 1) {
      idx /= last_div;
    }
    off += int64_t(idx) * strides[a];
  }
  return off;
}

#endif  // MLX_BRICKS_Q8_0_H
