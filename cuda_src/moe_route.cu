// CUDA twin of metal_src/moe_route.metal: the route array of the rows sorted by expert (layout
// in metal_src/moe.h), one block. Headers: moe.cuh.
//
// Template: E (experts), BM (rows per tile), NT (threads).
// Inputs: indices (R,) uint32, order (R,) uint32 (the ascending argsort of indices).
// Output: route (E + 2 + 2 * TILES,) int32, TILES = (R + min(E + 1, R) * (BM - 1)) / BM.
// Launch: grid (NT, 1, 1), block (NT, 1, 1), dynamic shared memory (2 * (E + 2) + NT) * 4
// bytes (moe/cuda.py: route_shared_memory).
extern __shared__ __align__(16) unsigned char smem[];
int* offs = reinterpret_cast<int*>(smem);  // first sorted row of expert e; offs[E + 1] = R
int* starts = offs + E + 2;                // first row tile of expert e; starts[E + 1] = tiles
int* scan = starts + E + 2;                // NT per-thread sums

const int R = int(order_shape[0]);
const int TILES = (R + min(E + 1, R) * (BM - 1)) / BM;
const int tid = int(threadIdx.x);

// 1. Offsets: each e in (expert of row r - 1, expert of row r] starts at row r (experts clamped
// to E are nondecreasing in sorted order; r = R stands for E + 1).
for (int r = tid; r <= R; r += NT) {
  const unsigned vp = r == 0 ? 0u : unsigned(indices[order[r - 1]]);
  const int prev = r == 0 ? -1 : (vp < unsigned(E) ? int(vp) : E);
  const unsigned vc = r == R ? 0u : unsigned(indices[order[r]]);
  const int cur = r == R ? E + 1 : (vc < unsigned(E) ? int(vc) : E);
  for (int e = prev + 1; e <= cur; ++e) offs[e] = r;
}
__syncthreads();

// 2. Tile starts: exclusive prefix sum of ceil(rows / BM) over e = 0 .. E (CH experts per
// thread), by an inclusive Hillis-Steele scan of the per-thread sums.
constexpr int CH = (E + 1 + NT - 1) / NT;
const int e0 = tid * CH;
int local = 0;
for (int e = e0; e < min(e0 + CH, E + 1); ++e) local += (offs[e + 1] - offs[e] + BM - 1) / BM;
scan[tid] = local;
__syncthreads();
for (int d = 1; d < NT; d <<= 1) {
  const int v = tid >= d ? scan[tid - d] : 0;
  __syncthreads();
  scan[tid] += v;
  __syncthreads();
}
int base = scan[tid] - local;
for (int e = e0; e < min(e0 + CH, E + 1); ++e) {
  starts[e] = base;
  base += (offs[e + 1] - offs[e] + BM - 1) / BM;
}
if (tid == 0) starts[E + 1] = scan[NT - 1];
__syncthreads();

// 3. The route: offsets, each expert's tiles, then the unused tiles (-1).
for (int e = tid; e < E + 2; e += NT) route[e] = offs[e];
int32_t* tile_expert = route + E + 2;
int32_t* tile_m0 = tile_expert + TILES;
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
