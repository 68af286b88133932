// CUDA twin of metal_src/moe_combine.metal: out[t, d] = sum_s scores[t, s] * y[t * k + s, d] in
// float32, one rounding to T. Headers: mma.cuh (to_float / from_float).
//
// Template: T (y's and out's dtype), NT (threads per block).
// Inputs: y (R, D); scores (tokens, k), any float dtype.
// Output: out (tokens, D).
// Launch: 1-D grid of ceil(tokens * D / NT) blocks of NT threads.
const int D = y_shape[1];
const int k = scores_shape[1];
const long n = long(scores_shape[0]) * D;
const long i = long(blockIdx.x) * NT + threadIdx.x;
if (i < n) {
  const long t = i / D;
  const long d = i - t * D;
  float acc = 0.0f;
  for (int s = 0; s < k; ++s) {
    acc = fmaf(bricks::to_float(scores[t * k + s]), bricks::to_float(y[(t * k + s) * D + d]), acc);
  }
  out[i] = bricks::from_float<T>(acc);
}
