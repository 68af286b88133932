// Inverse RMS of each row, once per row (the prologue of RMSNorm + QKV): inv_rms[m] =
// rsqrt(mean(x[m, :]^2) + eps) in float32, as mx.fast.rms_norm computes it. One warp per row.
// Headers: mma.cuh.
//
// Template: T (x's dtype).
// Inputs: x (M, K) row-contiguous; eps (0-d float32).
// Output: inv_rms (M,) float32.
// Launch: grid (ceil(M / 8) * 256, 1, 1), threadgroup (256, 1, 1).
const int M = x_shape[0];
const int K = x_shape[1];
const int row = int(blockIdx.x) * 8 + int(threadIdx.x) / 32;
const int lane = int(threadIdx.x) % 32;
if (row < M) {
  const T* xr = x + long(row) * K;
  float acc = 0.0f;
  if (K % 8 == 0 && (reinterpret_cast<uintptr_t>(xr) & 15) == 0) {
    for (int k = lane * 8; k < K; k += 32 * 8) {
      const uint4 c = *reinterpret_cast<const uint4*>(xr + k);
      const uint32_t* h = reinterpret_cast<const uint32_t*>(&c);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = bricks::unpack2<T>(h[e]);
        acc += f.x * f.x + f.y * f.y;
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      const float f = bricks::to_float(xr[k]);
      acc += f * f;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) inv_rms[row] = rsqrtf(acc / float(K) + eps[0]);
}
