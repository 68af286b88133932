// CUDA twin of RMSNorm + Q/K/V (metal_src/rms_norm_qkv.metal), on h = rms_norm(x) computed by
// mx.fast.rms_norm (a bandwidth-bound pass that costs ~1% of the projections on a GPU, while
// normalising inside the GEMM's A-load costs tensor-core issue slots every K step: measured
// 0.16x of stock on the H200, 2026-12-01). One launch computes the three projections: a virtual
// GEMM of h (M = B * L rows) times [wq; wk; wv]^T where each block computes one BM x BN tile of
// ONE projection (column tiles: q's, then k's, then v's), so weights are never concatenated,
// and the epilogue writes (B, H, L, head_dim) directly. Each projection has its own weight format
// (float or affine BITS / GS), as mlx-lm's mixed-precision recipes produce.
// Headers: mma.cuh, dequant.cuh, gemm.cuh, wgmma.cuh.
//
// Template: T, BM, BN, WM, WN, STAGES, BITS_Q, GS_Q, BITS_K, GS_K, BITS_V, GS_V (0 = float),
// HAS_BIAS, N_HEADS, N_KV_HEADS, HEAD_DIM, WGMMA, DEPTH (as gemm.cu).
// Inputs: h (B, L, K) row-contiguous; wq, sq, zq / wk, sk, zk / wv, sv, zv: each projection's
// (w, scales, biases) as gemm.cu's; bq, bk, bv (placeholders without bias).
// Outputs: q (B, N_HEADS, L, HEAD_DIM), k and v (B, N_KV_HEADS, L, HEAD_DIM).
// Launch: 1-D grid of ceil(M / BM) * (tiles_q + 2 * tiles_kv) blocks of WM * WN * 32 threads,
// dynamic shared memory: the largest GemmSmem of the three loaders.
using Cfg = bricks::GemmConfig<T, BM, BN, WM, WN, 1, STAGES, DEPTH>;
using Mma = typename bricks::MmaPolicy<Cfg, WGMMA>::type;
extern __shared__ __align__(1024) unsigned char smem[];
constexpr int NQ = N_HEADS * HEAD_DIM;
constexpr int NKV = N_KV_HEADS * HEAD_DIM;
constexpr int TQ = (NQ + BN - 1) / BN;
constexpr int TKV = (NKV + BN - 1) / BN;
const int L = h_shape[1];
const int K = h_shape[2];
const int M = h_shape[0] * L;
int tm, tn;
bricks::grouped_tile<8>(int(blockIdx.x), (M + BM - 1) / BM, TQ + 2 * TKV, tm, tn);
const int m0 = tm * BM;
auto run = [&](auto& bl, const T* bias, T* out, int N, int H, int n0) {
  auto epi = bricks::make_epilogue(bricks::AddBiasResidual<T, HAS_BIAS, false>{bias, nullptr, 0},
                                   bricks::HeadLayout<T>{out, L, H, HEAD_DIM}, M, N, m0, n0);
  bricks::gemm_block<Cfg, Mma>(smem, h, M, K, m0, bl, epi);
};
if (tn < TQ) {
  const void* ws[1] = {wq};
  const T* ss[1] = {sq};
  const T* zs[1] = {zq};
  typename bricks::WeightLoader<Cfg, BITS_Q, GS_Q>::type bl(ws, ss, zs, NQ, K, tn * BN);
  run(bl, bq, q, NQ, N_HEADS, tn * BN);
} else if (tn < TQ + TKV) {
  const void* ws[1] = {wk};
  const T* ss[1] = {sk};
  const T* zs[1] = {zk};
  typename bricks::WeightLoader<Cfg, BITS_K, GS_K>::type bl(ws, ss, zs, NKV, K, (tn - TQ) * BN);
  run(bl, bk, k, NKV, N_KV_HEADS, (tn - TQ) * BN);
} else {
  const void* ws[1] = {wv};
  const T* ss[1] = {sv};
  const T* zs[1] = {zv};
  typename bricks::WeightLoader<Cfg, BITS_V, GS_V>::type bl(ws, ss, zs, NKV, K,
                                                           (tn - TQ - TKV) * BN);
  run(bl, bv, v, NKV, N_KV_HEADS, (tn - TQ - TKV) * BN);
}
