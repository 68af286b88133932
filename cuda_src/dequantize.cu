// The dequantize brick's CUDA twin: MLX affine weights (2, 3, 4, 5, 6, 8 bits; group_size 32,
// 64, 128) to their float values, as mx.dequantize computes them (dequant.cuh: the conversion
// and its rounding). Headers: mma.cuh, dequant.cuh.
//
// Template: T (the scales' and biases' dtype: the computation's, as MLX's), O (the output
// dtype; values converted from T when it differs, as mx.dequantize(dtype=) does), BITS, GS,
// FUSED (T(s q + b) rounded once; false: T(T(s q) + b)), UNIT (values per thread: 128 when
// K % 128 == 0, else 32).
// Inputs: w uint32 (N, K * BITS / 32), scales and biases (N, K / GS) of T, all row-contiguous.
// Output: out (N, K) of O, every element written.
// Launch: 1-D grid of N * K / UNIT threads (rounded up to whole blocks), any block size
// (mlx_bricks/ops/dequantize_cuda.py), no shared memory.
const int N = w_shape[0];
const int K = w_shape[1] * 32 / BITS;
const int G = K / GS;
const int runs = K / UNIT;  // runs per row
const long long r = (long long)(blockIdx.x) * blockDim.x + threadIdx.x;
if (r < (long long)(N) * runs) {
  const int n = int(r / runs);
  const int k0 = int(r % runs) * UNIT;
  const uint32_t* wr = w + ((long long)(n) * K + k0) * BITS / 32;
  const bool vec16 = (reinterpret_cast<unsigned long long>(wr) & 15ull) == 0;
  bricks::dq::dequantize_run<T, O, BITS, GS, FUSED, UNIT>(
      wr, scales + (long long)(n) * G, biases + (long long)(n) * G, out + (long long)(n) * K + k0,
      k0, vec16);
}
