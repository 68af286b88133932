// RMSNorm + Q/K/V projections in one kernel, outputs written straight in head layout.
//
// Virtual GEMM: h = rms_norm(x) (M = B * L rows, K), times [wq; wk; wv]^T. Each threadgroup
// computes one BM x BN tile of ONE projection (the grid's x tiles are the q tiles, then the k
// tiles, then the v tiles), so the weight, bias and output are chosen once per threadgroup and
// the weights are never concatenated. Before the K loop the threadgroup computes the inverse
// RMS of its BM rows; the A loader then normalises x on its way into threadgroup memory.
//
// Template: T, BM, BN, BK, WM, WN, PAD, VEC (K % (16 / sizeof(T)) == 0), ALIGN_MN (M % BM == 0
// and both n_heads * HEAD_DIM and n_kv_heads * HEAD_DIM are multiples of BN), HAS_BIAS,
// N_HEADS, N_KV_HEADS, HEAD_DIM.
// Inputs: x (B, L, K) any strides; norm_weight (K,); eps (0-d float32); wq (N_HEADS * HEAD_DIM,
// K), wk, wv (N_KV_HEADS * HEAD_DIM, K) row-contiguous; bq, bk, bv (placeholders without bias).
// Outputs: q (B, N_HEADS, L, HEAD_DIM), k and v (B, N_KV_HEADS, L, HEAD_DIM).
// Grid: ((tiles_q + 2 * tiles_kv) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM*WN*32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
constexpr int NQ = N_HEADS * HEAD_DIM;
constexpr int NKV = N_KV_HEADS * HEAD_DIM;
constexpr int TILES_Q = (NQ + BN - 1) / BN;
constexpr int TILES_KV = (NKV + BN - 1) / BN;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = bricks::TileLoader<T, BN, BK, LDB, NT, decltype(wq + 0)>;
using MMA = bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB>;

threadgroup bricks::Vec128<T> As_store[2 * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[2 * LoaderB::TILE / LoaderB::VW];
threadgroup float inv_rms[BM];
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
const int N = proj == 0 ? NQ : NKV;
const int H = proj == 0 ? N_HEADS : N_KV_HEADS;
decltype(wq + 0) w_sel = proj == 0 ? wq : (proj == 1 ? wk : wv);
decltype(bq + 0) b_sel = proj == 0 ? bq : (proj == 1 ? bk : bv);
device T* out = proj == 0 ? q : (proj == 1 ? k : v);

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
for (short i = 0; i < LoaderA::NCH; ++i) {
  const int m = min(m0 + la.tile_row(i), M - 1);  // clamped rows are computed, never stored
  la.src[i] = x + bricks::strided_row_offset(m, x_shape, x_strides, 2);
}

LoaderB lb(tid, K);
lb.vec = VEC;
for (short i = 0; i < LoaderB::NCH; ++i) {
  const int n = min(n0 + lb.tile_row(i), N - 1);
  lb.src[i] = w_sel + long(n) * K;
}

bricks::tile_inv_rms<T, BM, WM * WN>(inv_rms, x, x_shape, x_strides, 2, m0, M, K, la.k_stride,
                                     x_vec, eps, sg, lane);
const bricks::RmsNormTransform<decltype(norm_weight + 0)> norm = {inv_rms, norm_weight, K};

MMA mma(sg, lane);
bricks::gemm_k_loop<BK>(la, lb, mma, As, Bs, K, norm);

// Epilogue: output column n = h * HEAD_DIM + d of row m = b * L + l goes to
// out[((b * H + h) * L + l) * HEAD_DIM + d].
const bool full = ALIGN_MN || (m0 + BM <= M && n0 + BN <= N);
for (short i = 0; i < MMA::TM; ++i) {
  const int r = mma.row0 + i * 8;
  if (!full && m0 + r >= M) continue;
  const int b = (m0 + r) / L;
  const int l = (m0 + r) - b * L;
  const long row_base = (long(b) * H * L + l) * HEAD_DIM;
  for (short j = 0; j < MMA::TN; ++j) {
    const thread auto& e = mma.acc[i][j].thread_elements();
    for (short t = 0; t < 2; ++t) {
      const int n = n0 + mma.col0 + j * 8 + t;
      if (!full && n >= N) continue;
      const int h = n / HEAD_DIM;
      const int d = n - h * HEAD_DIM;
      float val = e[t];
      if (HAS_BIAS) val += float(b_sel[n]);
      out[row_base + long(h) * L * HEAD_DIM + d] = T(val);
    }
  }
}
