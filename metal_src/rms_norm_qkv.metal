// RMSNorm + Q/K/V projections in one kernel, outputs written straight in head layout.
//
// Virtual GEMM: h = rms_norm(x) (M = B * L rows, K), times [wq; wk; wv]^T. Each threadgroup
// computes one BM x BN tile of ONE projection (the grid's x tiles are the q tiles, then the k
// tiles, then the v tiles), so the weight, bias and output are chosen once per threadgroup and
// the weights are never concatenated. The inverse RMS of every row comes from the rms_norm_inv
// kernel (computed once per row, not once per column tile); the A loader normalises x on its
// way into threadgroup memory.
//
// Template: T, BM, BN, BK, WM, WN, PAD, VEC (K % (16 / sizeof(T)) == 0), ALIGN_MN (M % BM == 0
// and both n_heads * HEAD_DIM and n_kv_heads * HEAD_DIM are multiples of BN), STAGES, SCHED
// (scheduling hints, see gemm.h), HAS_BIAS,
// N_HEADS, N_KV_HEADS, HEAD_DIM, and each weight's format BITS_Q/GROUP_SIZE_Q, BITS_K/
// GROUP_SIZE_K, BITS_V/GROUP_SIZE_V (0: float; else MLX affine, see gemm.metal).
// Inputs: x (B, L, K) any strides; norm_weight (K,); inv_rms (B * L,) float32 (rms_norm_inv);
// wq (N_HEADS * HEAD_DIM, K), wk, wv (N_KV_HEADS * HEAD_DIM, K) of T, or affine uint32 with
// their <w>_scales, <w>_biases; bq, bk, bv (placeholders without bias); row-contiguous.
// Outputs: q (B, N_HEADS, L, HEAD_DIM), k and v (B, N_KV_HEADS, L, HEAD_DIM).
// Grid: ((tiles_q + 2 * tiles_kv) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM*WN*32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
constexpr int NQ = N_HEADS * HEAD_DIM;
constexpr int NKV = N_KV_HEADS * HEAD_DIM;
constexpr int TILES_Q = (NQ + BN - 1) / BN;
constexpr int TILES_KV = (NKV + BN - 1) / BN;
using WeightQ = bricks::WeightOf<BITS_Q, GROUP_SIZE_Q, decltype(wq + 0), decltype(wq_scales + 0),
                                 decltype(wq_biases + 0)>;
using WeightK = bricks::WeightOf<BITS_K, GROUP_SIZE_K, decltype(wk + 0), decltype(wk_scales + 0),
                                 decltype(wk_biases + 0)>;
using WeightV = bricks::WeightOf<BITS_V, GROUP_SIZE_V, decltype(wv + 0), decltype(wv_scales + 0),
                                 decltype(wv_biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using Norm = bricks::RmsNormTransform<decltype(norm_weight + 0), decltype(inv_rms + 0)>;
using Projection = bricks::QkvProjection<T, BM, BN, BK, WM, WN, LDA, LDB, STAGES, SCHED,
                                         HEAD_DIM, HAS_BIAS, ALIGN_MN, LoaderA, Norm>;

// Every weight loader stages a BN x LDB tile of T, whatever the weight's format.
static_assert(STAGES * (BM + BN) * LDA * sizeof(T) <= 32768,
              "RMSNorm + QKV tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * BN * LDB / LoaderA::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int B = x_shape[0];
const int L = x_shape[1];
const int K = x_shape[2];
const int M = B * L;

// Which projection this threadgroup computes, and where its tile starts in it.
const int tile_x = int(threadgroup_position_in_grid.x);
const int proj = tile_x < TILES_Q ? 0 : (tile_x < TILES_Q + TILES_KV ? 1 : 2);
const int n0 = (tile_x - (proj == 0 ? 0 : (proj == 1 ? TILES_Q : TILES_Q + TILES_KV))) * BN;
const int m0 = int(threadgroup_position_in_grid.y) * BM;

const ushort tid = ushort(thread_index_in_threadgroup);
const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);

LoaderA la(tid, K);
bool x_vec = VEC && x_strides[2] == 1;
for (int d = 0; d < 2; ++d) {
  if (x_shape[d] > 1 && x_strides[d] % LoaderA::VW != 0) x_vec = false;
}
la.vec = x_vec;
la.k_stride = x_strides[2];
BRICKS_UNROLL
for (short i = 0; i < LoaderA::NCH; ++i) {
  const int m = min(m0 + la.tile_row(i), M - 1);  // clamped rows are computed, never stored
  la.src[i] = x + bricks::strided_row_offset(m, x_shape, x_strides, 2);
}

const Norm norm = {inv_rms + m0, M - m0, norm_weight, K};
Projection run = {&la, &norm, As, Bs, m0, n0, M, K, L, VEC, tid, sg, lane};
bricks::for_projection(run, proj, WeightQ::make(wq, wq_scales, wq_biases),
                       WeightK::make(wk, wk_scales, wk_biases),
                       WeightV::make(wv, wv_scales, wv_biases), bq, bk, bv, q, k, v, N_HEADS,
                       N_KV_HEADS, NQ, NKV);
