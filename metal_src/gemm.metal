// Bricks 1 and 2: y = x @ weight.T (+ bias) (+ residual), one BM x BN tile per threadgroup.
//
// Template: T (half, bfloat, float), BM, BN, BK, WM, WN (WM * WN simdgroups), PAD (row pitch
// padding, a multiple of the 128-bit vector width), VEC (K % (16 / sizeof(T)) == 0: 128-bit
// loads allowed), ALIGN_MN (M % BM == 0 and N % BN == 0: no store predication compiled),
// HAS_BIAS, HAS_RESIDUAL.
// Inputs: x (..., K) with any strides (rows = flattened leading dims), weight (N, K) and the
// optional bias (N,) and residual (M, N) row-contiguous (absent ones are placeholders that are
// never read). Output: y (M, N).
// Grid: (ceil(N / BN) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
// Inputs of fewer than 8 elements arrive as constant pointers: keep each input's own type.
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = bricks::TileLoader<T, BN, BK, LDB, NT, decltype(weight + 0)>;

// Ping-pong buffers of T, declared as 16-byte chunks so 128-bit threadgroup stores are aligned.
threadgroup bricks::Vec128<T> As_store[2 * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[2 * LoaderB::TILE / LoaderB::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int n_lead = x_ndim - 1;
const int K = x_shape[n_lead];
const int N = weight_shape[0];
int M = 1;
for (int d = 0; d < n_lead; ++d) M *= x_shape[d];

const int n0 = int(threadgroup_position_in_grid.x) * BN;
const int m0 = int(threadgroup_position_in_grid.y) * BM;
const ushort tid = ushort(thread_index_in_threadgroup);

// x: 128-bit loads need unit stride along K and 16-byte aligned row starts.
LoaderA la(tid, K);
bool x_vec = VEC && x_strides[n_lead] == 1;
for (int d = 0; d < n_lead; ++d) {
  if (x_shape[d] > 1 && x_strides[d] % LoaderA::VW != 0) x_vec = false;
}
la.vec = x_vec;
la.k_stride = x_strides[n_lead];
for (short i = 0; i < LoaderA::NCH; ++i) {
  const int m = min(m0 + la.tile_row(i), M - 1);  // clamped rows are computed, never stored
  la.src[i] = x + bricks::strided_row_offset(m, x_shape, x_strides, n_lead);
}

LoaderB lb(tid, K);
lb.vec = VEC;
for (short i = 0; i < LoaderB::NCH; ++i) {
  const int n = min(n0 + lb.tile_row(i), N - 1);
  lb.src[i] = weight + long(n) * K;
}

const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB> mma(sg, lane);
bricks::gemm_k_loop<BK>(la, lb, mma, As, Bs, K, bricks::NoTransform());

// Placeholders for absent bias/residual are never offset or read.
const bricks::BiasResidualEpilogue<HAS_BIAS, HAS_RESIDUAL, decltype(bias + 0),
                                   decltype(residual + 0)> epilogue = {
    HAS_BIAS ? bias + n0 : bias,
    HAS_RESIDUAL ? residual + long(m0) * N + n0 : residual,
    N};
device T* y_tile = y + long(m0) * N + n0;
if (ALIGN_MN || (m0 + BM <= M && n0 + BN <= N)) {
  mma.store(y_tile, N, epilogue);
} else {
  mma.store_checked(y_tile, N, M - m0, N - n0, epilogue);
}
