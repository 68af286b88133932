// Split-K GEMM twin, second pass: y = sum_s partial[s] (s = 0 .. SPLIT - 1, in order, float32)
// (+ bias[n]) (+ residual[m, n]), rounded once to T (the first pass: gemm_splitk.cu).
// Headers: mma.cuh.
//
// Template: T, SPLIT, HAS_BIAS, HAS_RESIDUAL.
// Inputs: partial (SPLIT, M, N) float32; bias (N,) and residual (M, N) of T (placeholders when
// absent, never read).
// Output: y (M, N) T. Launch: one thread per output element (1-D grid, any block size).
const int M = partial_shape[1];
const int N = partial_shape[2];
const long long i = (long long)(blockIdx.x) * blockDim.x + threadIdx.x;
if (i < (long long)(M) * N) {
  float acc = partial[i];
#pragma unroll
  for (int s = 1; s < SPLIT; ++s) acc += partial[(long long)(s) * M * N + i];
  if constexpr (HAS_BIAS) acc += bricks::to_float(bias[i % N]);
  if constexpr (HAS_RESIDUAL) acc += bricks::to_float(residual[i]);
  y[i] = bricks::from_float<T>(acc);
}
