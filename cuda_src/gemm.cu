// CUDA twin of Bricks 1 and 2 (metal_src/gemm.metal): y = x @ W.T (+ bias) (+ residual), W a
// 16-bit float weight or MLX affine weight; with SWIGLU_UP, the split SwiGLU's gate GEMM
// (metal_src/swiglu_split.metal): act = act(x @ W.T + bias) * up, act SiLU or GELU-tanh (ACT).
// Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh.
//
// Template: T (__half, __nv_bfloat16), BM, BN, WM, WN (WM * WN warps), STAGES (>= 3 for affine
// weights: a stage is dequantized one ahead), BITS (0: float weight; else 2..8 affine), GS
// (group size, affine only), HAS_BIAS, HAS_RESIDUAL, SWIGLU_UP, WGMMA (sm_90a warpgroup MMA,
// then WM = BM / 16 and WN = 1; else mma.sync), DEPTH (wgmma groups kept in flight, 0 or 1),
// ACT (SWIGLU_UP's gate activation: 0 SiLU, 1 GELU-tanh; gemm.cuh).
// Inputs: x (M, K) row-contiguous (the op reshapes / copies); w: (N, K) of T, or uint32
// (N, K * BITS / 32); scales, biases (N, K / GS) of T (placeholders for float weights); bias (N,);
// residual (M, N) (the up projection when SWIGLU_UP); absent ones are placeholders never read.
// Output: y (M, N).
// Launch: 1-D grid of ceil(M / BM) * ceil(N / BN) blocks of WM * WN * 32 threads (grouped
// order), dynamic shared memory GemmSmem<Cfg, loader>::TOTAL (mlx_bricks/ops/gemm_cuda.py).
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, 1, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
int tm, tn;
bricks::grouped_tile<8>(int(blockIdx.x), (M + BM - 1) / BM, (N + BN - 1) / BN, tm, tn);
const void* ws[1] = {w};
const T* ss[1] = {scales};
const T* bs[1] = {biases};
typename bricks::WeightLoader<Cfg, BITS, GS>::type bl(ws, ss, bs, N, K, tn * BN);
if constexpr (SWIGLU_UP) {
  auto epi = bricks::make_epilogue(bricks::GateTimesUp<T, HAS_BIAS, ACT>{bias, residual, N},
                                   bricks::RowMajor<T>{y, N}, M, N, tm * BM, tn * BN);
  bricks::gemm_block<Cfg, Mma>(smem, x, M, K, tm * BM, bl, epi);
} else {
  auto epi = bricks::make_epilogue(
      bricks::AddBiasResidual<T, HAS_BIAS, HAS_RESIDUAL>{bias, residual, N},
      bricks::RowMajor<T>{y, N}, M, N, tm * BM, tn * BN);
  bricks::gemm_block<Cfg, Mma>(smem, x, M, K, tm * BM, bl, epi);
}
