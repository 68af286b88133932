// MoE brick, gate-less up projection (mlx-lm's SwitchMLP: fc1, activation, fc2; nemotron_h's
// experts): act[row] = act1(x[tok] @ w_up[e].T + b_up[e]) for the rows sorted by expert, one
// BM x BN act tile of one expert per threadgroup (tok = order[row] / top_k, e the tile's expert
// from route; layout in moe.h). moe_down.metal's GEMM on the gathered rows of x (as
// moe_gate_up.metal), the activation in float registers before one write in sorted order;
// moe_down.metal then projects the rows back.
//
// Template: T (half, bfloat, float), BM, BN, BK, WM, WN, PAD, VEC (K % (16 / sizeof(T)) == 0),
// STAGES (as moe_gate_up.metal), BITS, GROUP_SIZE (w_up's format: 0 = float, else MLX affine),
// HAS_BIAS, ACT (4: ReLU^2; moe.h).
// Inputs: x (tokens, K) row-contiguous; order (R,) uint32 (argsort of the flattened indices,
// R = tokens * top_k); route (moe_route's output); w_up (E, N, K) of T, or affine (uint32
// (E, N, K * BITS / 32) with up_scales and up_biases (E, N, K / GROUP_SIZE) of T); the
// optional b_up (E, N) (a placeholder when absent, never read).
// Output: act (R, N), rows in sorted order.
// Grid: (ceil(N / BN) * WM * WN * 32, TILES, 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
using WeightOp = bricks::WeightOf<BITS, GROUP_SIZE, decltype(w_up + 0), decltype(up_scales + 0),
                                  decltype(up_biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = typename WeightOp::type::template Loader<T, BN, BK, LDB, NT>;

static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "MoE up tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * LoaderB::TILE / LoaderB::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int K = x_shape[1];
const int E = w_up_shape[0];
const int N = w_up_shape[1];
const int R = order_shape[0];
const int top_k = R / x_shape[0];
const int tiles = (route_shape[0] - E - 2) / 2;
const int n0 = int(threadgroup_position_in_grid.x) * BN;
const ushort tid = ushort(thread_index_in_threadgroup);

const bricks::RouteTile rt = bricks::route_tile(route, E, tiles,
                                                int(threadgroup_position_in_grid.y));
if (rt.expert < 0) return;  // past the last row tile: the whole threadgroup returns
const int rows = min(int(BM), rt.row_end - rt.m0);
if (rt.expert == E) {
  bricks::fill_nan_rows<false, BN, NT>(act, order, rt.m0, rows, n0, N, tid);
  return;
}
const int e = rt.expert;

LoaderA la(tid, K);
bricks::bind_gathered_rows(la, x, order, top_k, K, rt.m0, rt.row_end, VEC);
LoaderB lb(tid, K);
bricks::bind_weight_rows(lb, bricks::expert_weight<BITS, GROUP_SIZE>(w_up, up_scales, up_biases,
                                                                     e, N, K),
                         n0, N, K, VEC);

const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, K, bricks::NoTransform());

// The bias row at the block's first column; past N only for columns the checked store skips.
const auto bias = HAS_BIAS ? b_up + long(e) * N + n0 : b_up;
const bricks::UpActEpilogue<ACT, HAS_BIAS, decltype(bias)> op{bias};
device T* act_tile = act + long(rt.m0) * N + n0;
if (rows == BM && n0 + BN <= N) {
  mma.store(act_tile, N, op);
} else {
  mma.store_checked(act_tile, N, rows, N - n0, op);
}
