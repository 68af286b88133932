// Split-K GEMM twin, first pass: the partial products of K splits of y = x @ W.T (W a 16-bit
// float or MLX affine weight), for grids with fewer block tiles than SMs (the k / v projections:
// N = 1024 at M = 2048 is 64 tiles of 128 x 256 on 132 SMs). Split s computes its contiguous
// range of 64-wide K stages (gemm.cuh split_range) and stores float32 sums; the second pass
// (gemm_splitk_reduce.cu) adds the splits in order 0 .. SPLIT - 1, bias and residual, and rounds
// once. Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh.
//
// Template: T, BM, BN, WM, WN, STAGES, BITS, GS, WGMMA, DEPTH (as gemm.cu), SPLIT (splits).
// Inputs: x (M, K) row-contiguous; w, scales, biases as gemm.cu's.
// Output: partial (SPLIT, M, N) float32, every element written (an empty split writes zeros).
// Launch: 1-D grid of SPLIT * ceil(M / BM) * ceil(N / BN) blocks of WM * WN * 32 threads,
// dynamic shared memory GemmSmem<Cfg, loader>::TOTAL (mlx_bricks/ops/gemm_cuda.py).
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, 1, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int tiles_m = (M + BM - 1) / BM;
const int tiles_n = (N + BN - 1) / BN;
const int split = int(blockIdx.x) / (tiles_m * tiles_n);
int tm, tn;
bricks::grouped_tile<8>(int(blockIdx.x) % (tiles_m * tiles_n), tiles_m, tiles_n, tm, tn);
int first, last;
bricks::split_range(K, split, SPLIT, first, last);
const void* ws[1] = {w};
const T* ss[1] = {scales};
const T* bs[1] = {biases};
typename bricks::WeightLoader<Cfg, BITS, GS>::type bl(ws, ss, bs, N, K, tn * BN);
auto epi = bricks::make_epilogue(bricks::AddBiasResidual<T, false, false>{nullptr, nullptr, 0},
                                 bricks::RowMajor<float>{partial + long(split) * M * N, N}, M,
                                 N, tm * BM, tn * BN);
bricks::gemm_block<Cfg, Mma>(smem, x, M, K, tm * BM, bl, epi, first, last);
