// CUDA twin of metal_src/moe_gate_up.metal: act[row] = act(x[tok] @ w_gate[e].T + b_gate[e],
// x[tok] @ w_up[e].T + b_up[e]) for the rows sorted by expert, one BM x BN act tile of one expert
// per block (tok = order[row] / top_k; e from route), on gemm.cuh's mainloop (cp.async ring,
// mma.sync or wgmma, affine weights dequantized once per stage). Headers: mma.cuh, gemm.cuh,
// wgmma.cuh, moe.cuh.
//
// Template: T (__half, __nv_bfloat16), BM, BN, WM, WN, STAGES, WGMMA, DEPTH (as gemm.cu), BITS,
// GS (the staged weights' format), MODE (0: gate and up fused, one format; 1: up alone, writing
// up + b_up; 2: gate alone, reading that up: gate and up of different formats; 3: a gate-less
// expert's up alone, writing act1(up + b_up), its gate triple a placeholder), HAS_BIAS_GATE,
// HAS_BIAS_UP, ACT (0 SiLU, 1 GELU-tanh, 2 gpt-oss clamped SwiGLU, 3 SiTU; MODE 3: 4 ReLU^2).
// Inputs: x (tokens, K) row-contiguous; order (R,) uint32; route; w_gate / w_up triples (w of T
// (E, N, K) or uint32 (E, N, K * BITS / 32), scales / biases (E, N, K / GS) of T, placeholders
// for float weights); b_gate, b_up (E, N); act_params float32 (alpha, limit) / (beta,
// linear_beta) for ACT 2 / 3; up (R, N) for
// MODE 2. Absent ones are placeholders, never read.
// Output: act (R, N) in sorted order (MODE 1: up).
// Launch: 1-D grid of TILES * ceil(N / BN) blocks of WM * WN * 32 threads (n tiles fastest),
// dynamic shared memory GemmSmem<Cfg, loader>::TOTAL.
constexpr int NB = MODE == 0 ? 2 : 1;
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, NB, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
const int K = x_shape[1];
const int E = w_gate_shape[0];
const int N = w_gate_shape[1];
const int R = order_shape[0];
const int top_k = R / x_shape[0];
const int tiles = (route_shape[0] - E - 2) / 2;
const int n_tiles = (N + BN - 1) / BN;
const int tn = int(blockIdx.x) % n_tiles;
const int tid = int(threadIdx.x);
const bricks::RouteTile rt = bricks::route_tile(route, E, tiles, int(blockIdx.x) / n_tiles);
if (rt.expert < 0) return;  // past the last row tile: the whole block returns
if (rt.expert == E) {
  bricks::fill_nan_rows<false, BN>(act, order, rt.m0, min(BM, rt.row_end - rt.m0), tn * BN, N,
                                   tid, Cfg::THREADS);
  return;
}
const int e = rt.expert;
const void* wg;
const void* wu;
const T *sg, *bg, *su, *bu;
bricks::expert_operand<BITS, GS>(w_gate, scales_gate, biases_gate, e, N, K, wg, sg, bg);
bricks::expert_operand<BITS, GS>(w_up, scales_up, biases_up, e, N, K, wu, su, bu);
const void* ws[NB];
const T* ss[NB];
const T* bs[NB];
if constexpr (MODE == 0) {
  ws[0] = wg; ss[0] = sg; bs[0] = bg;
  ws[NB - 1] = wu; ss[NB - 1] = su; bs[NB - 1] = bu;
} else if constexpr (MODE == 1 || MODE == 3) {
  ws[0] = wu; ss[0] = su; bs[0] = bu;
} else {
  ws[0] = wg; ss[0] = sg; bs[0] = bg;
}
typename bricks::WeightLoader<Cfg, BITS, GS>::type bl(ws, ss, bs, N, K, tn * BN);
bricks::GatherALoader<Cfg> al(x, order, top_k, K, rt.m0, rt.row_end, tid);
Mma mma(tid / 32, tid % 32);
bricks::gemm_mainloop<Cfg>(bricks::align_smem(smem), al, bl, mma, K, tid);
bricks::MoeGateUpOut<T, MODE, HAS_BIAS_GATE, HAS_BIAS_UP, ACT> epi{
    act, b_gate + (HAS_BIAS_GATE ? long(e) * N : 0), b_up + (HAS_BIAS_UP ? long(e) * N : 0), up,
    rt.row_end, N, rt.m0, tn * BN, act_params[0], act_params[1]};
mma.for_each(epi);
