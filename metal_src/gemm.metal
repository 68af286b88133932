// Bricks 1 and 2: y = x @ weight.T (+ bias) (+ residual), one BM x BN tile per threadgroup.
//
// Template: T (half, bfloat, float), BM, BN, BK, WM, WN (WM * WN simdgroups), PAD (row pitch
// padding, a multiple of the 128-bit vector width), VEC (K % (16 / sizeof(T)) == 0: 128-bit
// loads allowed), ALIGN_MN (M % BM == 0 and N % BN == 0: no store predication compiled),
// STAGES (2: ping-pong buffers, 1: single buffer), SCHED (scheduling hints between fragment
// loads and MMAs, see gemm.h), HAS_BIAS, HAS_RESIDUAL, BITS (0: float
// weight; 2, 3, 4, 5, 6, 8: MLX affine-quantized weight) and GROUP_SIZE (affine group size).
// Inputs: x (..., K) with any strides (rows = flattened leading dims); weight (N, K) of T, or
// for BITS > 0 uint32 (N, K * BITS / 32) with scales and biases (N, K / GROUP_SIZE) of T; the
// optional bias (N,) and residual (M, N); all but x row-contiguous (absent ones are
// placeholders that are never read). Output: y (M, N).
// Grid: (ceil(N / BN) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
// Inputs of fewer than 8 elements arrive as constant pointers: keep each input's own type.
using WeightOp = bricks::WeightOf<BITS, GROUP_SIZE, decltype(weight + 0), decltype(scales + 0),
                                  decltype(biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = typename WeightOp::type::template Loader<T, BN, BK, LDB, NT>;

// STAGES buffers of T each, declared as 16-byte chunks so 128-bit threadgroup stores are aligned.
static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "GEMM tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * LoaderB::TILE / LoaderB::VW];
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
BRICKS_UNROLL
for (short i = 0; i < LoaderA::NCH; ++i) {
  const int m = min(m0 + la.tile_row(i), M - 1);  // clamped rows are computed, never stored
  la.src[i] = x + bricks::strided_row_offset(m, x_shape, x_strides, n_lead);
}

LoaderB lb(tid, K);
bricks::bind_weight_rows(lb, WeightOp::make(weight, scales, biases), n0, N, K, VEC);

const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB, SCHED> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, K, bricks::NoTransform());

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
