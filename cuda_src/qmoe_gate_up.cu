// The MoE gate / up on qgemm.cuh (qmoe.cuh): act[row] = act(x[tok] @ w_gate[e].T + b_gate[e],
// x[tok] @ w_up[e].T + b_up[e]) for the rows sorted by expert (tok = order[row] / top_k, e from
// route), gate and up MLX affine weights of one format dequantized in registers.
// Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh, qgemm.cuh, qgemm_ops.cuh,
// qgemm_wgmma.cuh, moe.cuh, qmoe.cuh.
//
// Template: T, BM, BN (weight rows per block: BN / 2 act columns), STAGES, WGMMA, MI, WR,
// DEPTH, BITS, GS (as qgemm.cu), HAS_BIAS_GATE, HAS_BIAS_UP, ACT (0 SiLU, 1 GELU-tanh, 2
// gpt-oss clamped SwiGLU, 3 SiTU).
// Inputs: x (tokens, K) row-contiguous; order (R,) uint32; route (moe.cuh); w_gate / w_up uint32
// (E, N, K * BITS / 32) with scales / biases (E, N, K / GS) of T; b_gate, b_up (E, N)
// (placeholders when absent); act_params float32 (alpha, limit) for ACT 2, (beta, linear_beta)
// for ACT 3.
// Output: act (R, N) in sorted order.
// Launch: 1-D grid of TILES * ceil(N / (BN / 2)) blocks of 384 threads, dynamic shared memory
// QConfig::SMEM (NB = 2).
using Cfg = bricks::QConfig<T, BM, BN, 2, STAGES, BITS, GS>;
extern __shared__ __align__(1024) unsigned char smem[];
const int K = x_shape[1];
const int E = w_gate_shape[0];
const int N = w_gate_shape[1];
const int R = order_shape[0];
const int tiles = (route_shape[0] - E - 2) / 2;
const void* ws[2] = {w_gate, w_up};
const T* ss[2] = {scales_gate, scales_up};
const T* bs[2] = {biases_gate, biases_up};
const float alpha = act_params[0], limit = act_params[1];
auto make_op = [&](int e) {
  return bricks::QMoeGateUp<T, HAS_BIAS_GATE, HAS_BIAS_UP, ACT>{
      b_gate + (HAS_BIAS_GATE ? long(e) * N : 0), b_up + (HAS_BIAS_UP ? long(e) * N : 0), alpha,
      limit};
};
bricks::qmoe_block<Cfg, WGMMA, MI, WR, DEPTH, true, false>(
    smem, x, K, order, R / x_shape[0], route, E, tiles, N, ws, ss, bs, make_op, act);
