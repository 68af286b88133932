// MoE brick, routing: from the rows sorted by expert (order = argsort(indices)) to the route
// array the grouped GEMMs read (layout in moe.h): per-expert row offsets and, for every row tile
// of BM rows, its expert and first row. One threadgroup; nothing leaves the device.
//
// Template: E (experts), BM (rows per tile of the GEMMs), NT (threads, a multiple of 32).
// Inputs: indices (R,) uint32 (the flattened top-k; values >= E, and negative ones cast to
// uint32, form the out-of-range tail "expert" E), order (R,) uint32, the ascending argsort of
// indices.
// Output: route (E + 2 + 2 * TILES,) int32, TILES = (R + min(E + 1, R) * (BM - 1)) / BM (an upper
// bound of the row tiles; moe/msl.py computes the same).
// Grid: (NT, 1, 1), threadgroup (NT, 1, 1).

threadgroup int offs[E + 2];    // offs[e]: first sorted row of expert e; offs[E + 1] = R
threadgroup int starts[E + 2];  // first row tile of expert e; starts[E + 1] = the tile count
threadgroup int sg_base[NT / 32];

const int R = int(order_shape[0]);
const int TILES = (R + min(E + 1, R) * (BM - 1)) / BM;
const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);

// 1. Offsets: the experts of the sorted rows are nondecreasing (clamped to E), so expert e
// starts at the first row whose expert is >= e; each e in (expert of row r - 1, expert of r] is
// set by row r alone (r = R stands for an expert past all, E + 1).
for (int r = tid; r <= R; r += NT) {
  const uint vp = r == 0 ? 0u : uint(indices[order[r - 1]]);
  const int prev = r == 0 ? -1 : (vp < uint(E) ? int(vp) : E);
  const uint vc = r == R ? 0u : uint(indices[order[r]]);
  const int cur = r == R ? E + 1 : (vc < uint(E) ? int(vc) : E);
  for (int e = prev + 1; e <= cur; ++e) offs[e] = r;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 2. Tile starts: exclusive prefix sum of ceil(rows / BM) over e = 0 .. E, each thread owning
// CH consecutive experts (one when E + 1 <= NT).
constexpr int CH = (E + 1 + NT - 1) / NT;
const int e0 = tid * CH;
int local = 0;
for (int e = e0; e < min(e0 + CH, E + 1); ++e) local += (offs[e + 1] - offs[e] + BM - 1) / BM;
int base = simd_prefix_exclusive_sum(local);
const int sg_total = simd_sum(local);
if (lane == 0) sg_base[sg] = sg_total;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  const int v = lane < NT / 32 ? sg_base[lane] : 0;
  const int before = simd_prefix_exclusive_sum(v);
  const int total = simd_sum(v);
  if (lane < NT / 32) sg_base[lane] = before;
  if (lane == 0) starts[E + 1] = total;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
base += sg_base[sg];
for (int e = e0; e < min(e0 + CH, E + 1); ++e) {
  starts[e] = base;
  base += (offs[e + 1] - offs[e] + BM - 1) / BM;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 3. The route: offsets, then each expert's tiles, then the unused tiles (-1).
for (int e = tid; e < E + 2; e += NT) route[e] = offs[e];
device int* tile_expert = route + E + 2;
device int* tile_m0 = tile_expert + TILES;
for (int e = e0; e < min(e0 + CH, E + 1); ++e) {
  const int n = starts[e + 1] - starts[e];
  for (int i = 0; i < n; ++i) {
    tile_expert[starts[e] + i] = e;
    tile_m0[starts[e] + i] = offs[e] + i * BM;
  }
}
for (int t = starts[E + 1] + tid; t < TILES; t += NT) {
  tile_expert[t] = -1;
  tile_m0[t] = 0;
}
