// The quantized linear on qgemm.cuh: y = x @ W.T (+ bias) (+ residual), W an MLX affine weight
// (4 or 8 bits, group 32 / 64 / 128) dequantized in registers, never staged as a 16-bit tile.
// Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh, qgemm.cuh, qgemm_ops.cuh,
// qgemm_wgmma.cuh.
//
// Template: T (__half, __nv_bfloat16), BM (tokens per block), BN (weight rows per block),
// STAGES, WGMMA (sm_90a: two warpgroups, MI m64 blocks each; else mma.sync, WR warps along the
// weight rows with MI m16 blocks each), MI, WR, DEPTH (wgmma groups in flight), BITS (4, 8),
// GS, HAS_BIAS, HAS_RESIDUAL.
// Inputs: x (M, K) row-contiguous; w uint32 (N, K * BITS / 32); scales, biases (N, K / GS) of
// T; bias (N,), residual (M, N) (placeholders when absent, never read).
// Output: y (M, N).
// Launch: 1-D grid of ceil(M / BM) * ceil(N / BN) blocks of 384 threads, dynamic shared
// memory QConfig::SMEM (mlx_bricks/bricks/gemm/cuda.py).
using Cfg = bricks::QConfig<T, BM, BN, 1, STAGES, BITS, GS>;
extern __shared__ __align__(1024) unsigned char smem[];
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const void* ws[1] = {w};
const T* ss[1] = {scales};
const T* bs[1] = {biases};
const bricks::QBiasResidual<T, HAS_BIAS, HAS_RESIDUAL> op{bias, residual, N};
bricks::qgemm_block<Cfg, WGMMA, MI, WR, DEPTH>(smem, x, M, K, N, ws, ss, bs, op, y);
