// Brick 3, fused variant: out = act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up) in one
// kernel, one BM x BN act tile per threadgroup. Each K step loads the x tile into threadgroup
// memory once and the 2 * BN weight rows (BN of w_gate, BN of w_up) beside it; every simdgroup
// multiplies its x fragments by both, so gate and up of an element meet in the same lane and
// act(gate) * up is formed in float registers and written once (act: SiLU or GELU-tanh, ACT).
//
// Template: T (half, bfloat, float), BM, BN (act columns per tile), BK, WM, WN (WM * WN
// simdgroups), PAD (row pitch padding, a multiple of the 128-bit vector width), VEC
// (K % (16 / sizeof(T)) == 0: 128-bit loads allowed), ALIGN_MN (M % BM == 0 and N % BN == 0: no
// store predication compiled), STAGES (2: ping-pong buffers, 1: single buffer), SCHED
// (scheduling hints, see gemm.h), HAS_BIAS_GATE,
// HAS_BIAS_UP, BITS and GROUP_SIZE (the weights' format, one for both: 0 = float, else MLX
// affine; see gemm.metal), ACT (the gate's activation: 0 SiLU, 1 GELU-tanh; see swiglu.h).
// Inputs: x (..., K) with any strides (rows = flattened leading dims); w_gate and w_up (N, K)
// of T, or affine (uint32 (N, K * BITS / 32) with gate_/up_ scales and biases
// (N, K / GROUP_SIZE) of T); the optional b_gate, b_up (N,); all but x row-contiguous (absent
// ones are placeholders, never read).
// Output: act (M, N).
// Grid: (ceil(N / BN) * WM * WN * 32, ceil(M / BM), 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
// Inputs of fewer than 8 elements arrive as constant pointers: keep each input's own type.
using WeightOp = bricks::WeightOf<BITS, GROUP_SIZE, decltype(w_gate + 0),
                                  decltype(gate_scales + 0), decltype(gate_biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = typename WeightOp::type::template Loader<T, 2 * BN, BK, LDB, NT>;

// STAGES buffers each of the x tile (BM rows) and the weight tile (2 * BN rows), as 16-byte
// chunks so 128-bit threadgroup stores are aligned.
static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "fused SwiGLU tile needs more than 32 KB of threadgroup memory");
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
bricks::bind_gate_up_rows<BN>(lb, WeightOp::make(w_gate, gate_scales, gate_biases),
                              WeightOp::make(w_up, up_scales, up_biases), n0, N, K, VEC);

// Named locals: `mma(ushort(a), ushort(b))` would declare a function (most vexing parse).
const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::GateUpMMA<BM, BN, BK, WM, WN, LDA, LDB, SCHED> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, K, bricks::NoTransform());
bricks::swiglu_combine<ACT, HAS_BIAS_GATE, HAS_BIAS_UP>(mma, b_gate, b_up, n0, N);

device T* act_tile = act + long(m0) * N + n0;
if (ALIGN_MN || (m0 + BM <= M && n0 + BN <= N)) {
  mma.gate.store(act_tile, N, bricks::StoreAsIs());
} else {
  mma.gate.store_checked(act_tile, N, M - m0, N - n0, bricks::StoreAsIs());
}
