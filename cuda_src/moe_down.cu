// CUDA twin of metal_src/moe_down.metal: y[order[row]] = act[row] @ w_down[e].T + b_down[e] for
// the rows sorted by expert, one BM x BN tile of one expert per block, the un-sort to (token,
// slot) order fused in the epilogue. Headers: mma.cuh, gemm.cuh, wgmma.cuh, moe.cuh.
//
// Template: T, BM, BN, WM, WN, STAGES, WGMMA, DEPTH (as gemm.cu), BITS, GS (w_down's format),
// HAS_BIAS.
// Inputs: act (R, N); order (R,) uint32; route; w_down triple (w of T (E, D, N) or uint32
// (E, D, N * BITS / 32), down_scales / down_biases (E, D, N / GS) of T, placeholders for a float
// weight); b_down (E, D) (a placeholder when absent).
// Output: y (R, D), row r = (token r / top_k, slot r % top_k).
// Launch: 1-D grid of TILES * ceil(D / BN) blocks of WM * WN * 32 threads (n tiles fastest),
// dynamic shared memory GemmSmem<Cfg, loader>::TOTAL.
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, 1, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
const int N = act_shape[1];  // the GEMM's K: the expert intermediate size
const int R = act_shape[0];
const int E = w_down_shape[0];
const int D = w_down_shape[1];
const int tiles = (route_shape[0] - E - 2) / 2;
const int n_tiles = (D + BN - 1) / BN;
const int tn = int(blockIdx.x) % n_tiles;
const int tid = int(threadIdx.x);
const bricks::RouteTile rt = bricks::route_tile(route, E, tiles, int(blockIdx.x) / n_tiles);
if (rt.expert < 0) return;
if (rt.expert == E) {
  bricks::fill_nan_rows<true, BN>(y, order, rt.m0, min(BM, rt.row_end - rt.m0), tn * BN, D,
                                  tid, Cfg::THREADS);
  return;
}
const int e = rt.expert;
const void* ws[1];
const T* ss[1];
const T* bs[1];
bricks::expert_operand<BITS, GS>(w_down, down_scales, down_biases, e, D, N, ws[0], ss[0], bs[0]);
typename bricks::WeightLoader<Cfg, BITS, GS>::type bl(ws, ss, bs, D, N, tn * BN);
bricks::ALoader<Cfg> al(act, N, rt.row_end, N, rt.m0);
Mma mma(tid / 32, tid % 32);
bricks::gemm_mainloop<Cfg>(bricks::align_smem(smem), al, bl, mma, N, tid);
bricks::ScatterOut<T, HAS_BIAS> epi{y, b_down + (HAS_BIAS ? long(e) * D : 0), order, rt.row_end,
                                    D, rt.m0, tn * BN, R};
mma.for_each(epi);
