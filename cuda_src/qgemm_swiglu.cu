// The fused SwiGLU on qgemm.cuh: act = act(x @ Wg.T + b_gate) * (x @ Wu.T + b_up), gate and up
// MLX affine weights of one format dequantized in registers. Each block stages BN / 2 rows of
// each weight (the first consumer half computes gate, the second up, on the same x tile); the
// two accumulator tiles meet in shared memory and the activation is written once.
// Headers: as qgemm.cu.
//
// Template: as qgemm.cu, with HAS_BIAS_GATE, HAS_BIAS_UP and ACT (0 SiLU, 1 GELU-tanh;
// gemm.cuh) in place of HAS_BIAS / HAS_RESIDUAL.
// Inputs: x (M, K) row-contiguous; w_gate, scales_gate, biases_gate and w_up, scales_up,
// biases_up as qgemm.cu's weight; b_gate, b_up (N,) (placeholders when absent).
// Output: act (M, N).
// Launch: 1-D grid of ceil(M / BM) * ceil(N / (BN / 2)) blocks of 384 threads, dynamic shared
// memory QConfig::SMEM (NB = 2).
using Cfg = bricks::QConfig<T, BM, BN, 2, STAGES, BITS, GS>;
extern __shared__ __align__(1024) unsigned char smem[];
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_gate_shape[0];
const void* ws[2] = {w_gate, w_up};
const T* ss[2] = {scales_gate, scales_up};
const T* bs[2] = {biases_gate, biases_up};
const bricks::QGateUp<T, HAS_BIAS_GATE, HAS_BIAS_UP, ACT> op{b_gate, b_up};
bricks::qgemm_block<Cfg, WGMMA, MI, WR, DEPTH>(smem, x, M, K, N, ws, ss, bs, op, act);
