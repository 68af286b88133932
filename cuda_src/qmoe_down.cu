// The MoE down projection on qgemm.cuh (qmoe.cuh): y[order[row]] = act[row] @ w_down[e].T +
// b_down[e] for the rows sorted by expert, the un-sort to (token, slot) order in the epilogue,
// w_down an MLX affine weight dequantized in registers. Headers: as qmoe_gate_up.cu.
//
// Template: T, BM, BN, STAGES, WGMMA, MI, WR, DEPTH, BITS, GS (as qgemm.cu), HAS_BIAS.
// Inputs: act (R, N) row-contiguous; order (R,) uint32; route; w_down uint32
// (E, D, N * BITS / 32) with down_scales / down_biases (E, D, N / GS) of T; b_down (E, D)
// (a placeholder when absent).
// Output: y (R, D), row r = (token r / top_k, slot r % top_k).
// Launch: 1-D grid of TILES * ceil(D / BN) blocks of 384 threads, dynamic shared memory
// QConfig::SMEM.
using Cfg = bricks::QConfig<T, BM, BN, 1, STAGES, BITS, GS>;
extern __shared__ __align__(1024) unsigned char smem[];
const int N = act_shape[1];  // the GEMM's K: the expert intermediate size
const int E = w_down_shape[0];
const int D = w_down_shape[1];
const int tiles = (route_shape[0] - E - 2) / 2;
const void* ws[1] = {w_down};
const T* ss[1] = {down_scales};
const T* bs[1] = {down_biases};
auto make_op = [&](int e) {
  return bricks::QBiasResidual<T, HAS_BIAS, false>{b_down + (HAS_BIAS ? long(e) * D : 0),
                                                   nullptr, D};
};
bricks::qmoe_block<Cfg, WGMMA, MI, WR, DEPTH, false, true>(
    smem, act, N, order, 1, route, E, tiles, D, ws, ss, bs, make_op, y);
