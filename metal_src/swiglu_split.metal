// Brick 3, split variant, second kernel: out = act(x @ w_gate.T + b_gate) * up, the gate GEMM
// of the GEMM brick's tiling with an epilogue that reads up = x @ w_up.T + b_up (computed before
// by the GEMM brick) at each stored element. One BM x BN act tile per threadgroup.
//
// Template: the GEMM brick's (T, BM, BN, BK, WM, WN, PAD, VEC, ALIGN_MN, STAGES, SCHED, HAS_BIAS,
// HAS_RESIDUAL, BITS, GROUP_SIZE; see gemm.metal); HAS_BIAS is b_gate's, HAS_RESIDUAL is unused
// (always false), BITS and GROUP_SIZE are w_gate's format; ACT is the gate's activation (0 SiLU,
// 1 GELU-tanh; see swiglu.h).
// Inputs: x (..., K) with any strides (rows = flattened leading dims), w_gate (N, K) of T or
// affine (uint32 with gate_scales, gate_biases; see gemm.metal), the optional b_gate (N,) (a
// placeholder when absent, never read) and up (M, N), row-contiguous.
// Output: act (M, N).
// Grid: (ceil(N / BN) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
// Inputs of fewer than 8 elements arrive as constant pointers: keep each input's own type.
using WeightOp = bricks::WeightOf<BITS, GROUP_SIZE, decltype(w_gate + 0),
                                  decltype(gate_scales + 0), decltype(gate_biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = typename WeightOp::type::template Loader<T, BN, BK, LDB, NT>;

// STAGES buffers per operand as 16-byte chunks so 128-bit threadgroup stores are aligned.
static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "split SwiGLU tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * LoaderB::TILE / LoaderB::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int n_lead = x_ndim - 1;
const int K = x_shape[n_lead];
const int N = w_gate_shape[0];
int M = 1;
for (int d = 0; d < n_lead; ++d) M *= x_shape[d];

const int n0 = int(threadgroup_position_in_grid.x) * BN;
const int m0 = int(threadgroup_position_in_grid.y) * BM;
const ushort tid = ushort(thread_index_in_threadgroup);

LoaderA la(tid, K);
bricks::bind_x_rows(la, x, x_shape, x_strides, n_lead, M, m0, VEC);
LoaderB lb(tid, K);
bricks::bind_weight_rows(lb, WeightOp::make(w_gate, gate_scales, gate_biases), n0, N, K, VEC);

// Named locals: `mma(ushort(a), ushort(b))` would declare a function (most vexing parse).
const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB, SCHED> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, K, bricks::NoTransform());

const bricks::SwiGLUUpEpilogue<ACT, HAS_BIAS, decltype(b_gate + 0), decltype(up + 0)> epilogue = {
    HAS_BIAS ? b_gate + n0 : b_gate, up + long(m0) * N + n0, N};
device T* act_tile = act + long(m0) * N + n0;
if (ALIGN_MN || (m0 + BM <= M && n0 + BN <= N)) {
  mma.store(act_tile, N, epilogue);
} else {
  mma.store_checked(act_tile, N, M - m0, N - n0, epilogue);
}
