// MoE brick, down projection: y[order[row]] = act[row] @ w_down[e].T + b_down[e] for the rows
// sorted by expert, one BM x BN tile of one expert per threadgroup (e from route; layout in
// moe.h): the GEMM brick's pipeline on contiguous rows of act, with an epilogue that writes each
// sorted row to its (token, slot) row, so the output is back in token order (the un-sort fused).
//
// Template: T (half, bfloat, float), BM, BN, BK, WM, WN, PAD, VEC (N % (16 / sizeof(T)) == 0),
// STAGES (as moe_gate_up.metal), BITS, GROUP_SIZE (w_down's format: 0 = float, else MLX affine),
// HAS_BIAS.
// Inputs: act (R, N) (moe_gate_up's output); order (R,) uint32; route; w_down (E, D, N) of T or
// affine (uint32 (E, D, N * BITS / 32), down_scales / down_biases (E, D, N / GROUP_SIZE) of T);
// the optional b_down (E, D) (a placeholder when absent, never read).
// Output: y (R, D), row r the result of (token r / top_k, slot r % top_k).
// Grid: (ceil(D / BN) * WM * WN * 32, TILES, 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
using WeightOp = bricks::WeightOf<BITS, GROUP_SIZE, decltype(w_down + 0),
                                  decltype(down_scales + 0), decltype(down_biases + 0)>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(act + 0)>;
using LoaderB = typename WeightOp::type::template Loader<T, BN, BK, LDB, NT>;

static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "MoE down tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * LoaderB::TILE / LoaderB::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int N = act_shape[1];  // the GEMM's K: the expert intermediate size
const int E = w_down_shape[0];
const int D = w_down_shape[1];
const int tiles = (route_shape[0] - E - 2) / 2;
const int n0 = int(threadgroup_position_in_grid.x) * BN;
const ushort tid = ushort(thread_index_in_threadgroup);

const bricks::RouteTile rt = bricks::route_tile(route, E, tiles,
                                                int(threadgroup_position_in_grid.y));
if (rt.expert < 0) return;  // past the last row tile: the whole threadgroup returns
const int rows = min(int(BM), rt.row_end - rt.m0);
if (rt.expert == E) {
  bricks::fill_nan_rows<true, BN, NT>(y, order, rt.m0, rows, n0, D, tid);
  return;
}
const int e = rt.expert;

LoaderA la(tid, N);
la.vec = VEC;
la.k_stride = 1;
BRICKS_UNROLL
for (short i = 0; i < LoaderA::NCH; ++i) {
  la.src[i] = act + long(min(rt.m0 + int(la.tile_row(i)), rt.row_end - 1)) * N;
}
LoaderB lb(tid, N);
bricks::bind_weight_rows(
    lb, bricks::expert_weight<BITS, GROUP_SIZE>(w_down, down_scales, down_biases, e, D, N), n0,
    D, N, VEC);

const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, N, bricks::NoTransform());
bricks::scatter_store<HAS_BIAS>(mma, y, order, HAS_BIAS ? b_down + long(e) * D : b_down, rt.m0,
                                rows, n0, D);
