// CUDA twin of Brick 3, fused variant (metal_src/swiglu_fused.metal):
// act = act(x @ Wg.T + b_gate) * (x @ Wu.T + b_up) (act: SiLU or GELU-tanh, ACT), one kernel:
// each block stages one x tile and BN rows of each weight per K step; every warp holds gate and
// up of the same outputs in the same lanes, so act(gate) * up is formed in float registers and
// written once.
// Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh.
//
// Template: T, BM, BN (act columns per block), WM, WN, STAGES, BITS (0: float weights; else
// affine, the same for gate and up), GS, HAS_BIAS_GATE, HAS_BIAS_UP, WGMMA, DEPTH (as gemm.cu),
// ACT (the gate's activation: 0 SiLU, 1 GELU-tanh; gemm.cuh).
// Inputs: x (M, K) row-contiguous; w_gate, w_up and their scales / biases triples as gemm.cu's
// w / scales / biases; b_gate, b_up (N,) (placeholders when absent).
// Output: act (M, N).
// Launch: 1-D grid of ceil(M / BM) * ceil(N / BN) blocks of WM * WN * 32 threads, dynamic shared
// memory GemmSmem<Cfg (NB = 2), loader>::TOTAL.
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, 2, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_gate_shape[0];
int tm, tn;
bricks::grouped_tile<8>(int(blockIdx.x), (M + BM - 1) / BM, (N + BN - 1) / BN, tm, tn);
const void* ws[2] = {w_gate, w_up};
const T* ss[2] = {scales_gate, scales_up};
const T* bs[2] = {biases_gate, biases_up};
typename bricks::WeightLoader<Cfg, BITS, GS>::type bl(ws, ss, bs, N, K, tn * BN);
auto epi = bricks::make_epilogue(bricks::GateUp<T, HAS_BIAS_GATE, HAS_BIAS_UP, ACT>{b_gate, b_up},
                                 bricks::RowMajor<T>{act, N}, M, N, tm * BM, tn * BN);
bricks::gemm_block<Cfg, Mma>(smem, x, M, K, tm * BM, bl, epi);
