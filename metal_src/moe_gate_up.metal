// MoE brick, gate/up: act[row] = act(x[tok] @ w_gate[e].T + b_gate[e], x[tok] @ w_up[e].T +
// b_up[e]) for the rows sorted by expert, one BM x BN act tile of one expert per threadgroup
// (tok = order[row] / top_k, e the tile's expert from route; layout in moe.h). The fused SwiGLU
// kernel's structure: per K step one x tile (gathered rows) and 2 * BN weight rows (BN of w_gate,
// BN of w_up) in threadgroup memory, every simdgroup multiplies its x fragments by both, and the
// activation is applied in float registers before one write.
//
// Template: T (half, bfloat, float), BM, BN (act columns per tile), BK, WM, WN (WM * WN
// simdgroups), PAD (row pitch padding, a multiple of the 128-bit vector width), VEC
// (K % (16 / sizeof(T)) == 0: 128-bit loads), STAGES (2: ping-pong buffers, 1: single buffer),
// BITS_G, GS_G, BITS_U, GS_U (w_gate's and w_up's formats, each its own: 0 = float, else MLX
// affine; one loader of 2 * BN rows when they are the same), HAS_BIAS_GATE, HAS_BIAS_UP, ACT (0
// SiLU, 1 GELU-tanh, 2 gpt-oss clamped SwiGLU, 3 SiTU; moe.h).
// Inputs: x (tokens, K) row-contiguous; order (R,) uint32 (argsort of the flattened indices,
// R = tokens * top_k); route (moe_route's output); w_gate and w_up (E, N, K) of T, or affine
// (uint32 (E, N, K * BITS / 32) with scales and biases (E, N, K / GS) of T); the optional
// b_gate, b_up (E, N); act_params float32 (alpha, limit) for ACT 2, (beta, linear_beta) for
// ACT 3. Absent ones are
// placeholders, never read.
// Output: act (R, N), rows in sorted order.
// Grid: (ceil(N / BN) * WM * WN * 32, TILES, 1), threadgroup (WM * WN * 32, 1, 1).

constexpr short LDA = BK + PAD;
constexpr short LDB = BK + PAD;
constexpr short NT = WM * WN * 32;
// Inputs of fewer than 8 elements arrive as constant pointers: keep each input's own type.
using WG = typename bricks::WeightOf<BITS_G, GS_G, decltype(w_gate + 0),
                                     decltype(gate_scales + 0), decltype(gate_biases + 0)>::type;
using WU = typename bricks::WeightOf<BITS_U, GS_U, decltype(w_up + 0), decltype(up_scales + 0),
                                     decltype(up_biases + 0)>::type;
using GateUp = bricks::GateUpLoaderOf<bricks::SameType<WG, WU>::value, T, BN, BK, LDB, NT, WG, WU>;
using LoaderA = bricks::TileLoader<T, BM, BK, LDA, NT, decltype(x + 0)>;
using LoaderB = typename GateUp::type;

static_assert(STAGES * (LoaderA::TILE + LoaderB::TILE) * sizeof(T) <= 32768,
              "MoE gate/up tile needs more than 32 KB of threadgroup memory");
threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
threadgroup bricks::Vec128<T> Bs_store[STAGES * LoaderB::TILE / LoaderB::VW];
threadgroup T* As = reinterpret_cast<threadgroup T*>(As_store);
threadgroup T* Bs = reinterpret_cast<threadgroup T*>(Bs_store);

const int K = x_shape[1];
const int E = w_gate_shape[0];
const int N = w_gate_shape[1];
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
GateUp::bind(lb, bricks::expert_weight<BITS_G, GS_G>(w_gate, gate_scales, gate_biases, e, N, K),
             bricks::expert_weight<BITS_U, GS_U>(w_up, up_scales, up_biases, e, N, K), n0, N, K,
             VEC);

// Named locals: `mma(ushort(a), ushort(b))` would declare a function (most vexing parse).
const ushort sg = ushort(simdgroup_index_in_threadgroup);
const ushort lane = ushort(thread_index_in_simdgroup);
bricks::GateUpMMA<BM, BN, BK, WM, WN, LDA, LDB> mma(sg, lane);
bricks::gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs, K, bricks::NoTransform());
bricks::moe_gate_up_combine<ACT, HAS_BIAS_GATE, HAS_BIAS_UP>(
    mma, HAS_BIAS_GATE ? b_gate + long(e) * N : b_gate, HAS_BIAS_UP ? b_up + long(e) * N : b_up,
    n0, N, ACT >= bricks::ACT_SWIGLU_OAI ? float(act_params[0]) : 0.0f,
    ACT >= bricks::ACT_SWIGLU_OAI ? float(act_params[1]) : 0.0f);

device T* act_tile = act + long(rt.m0) * N + n0;
if (rows == BM && n0 + BN <= N) {
  mma.gate.store(act_tile, N, bricks::StoreAsIs());
} else {
  mma.gate.store_checked(act_tile, N, rows, N - n0, bricks::StoreAsIs());
}
