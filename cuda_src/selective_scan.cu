// Selective-scan brick: CUDA twin of metal_src/selective_scan.metal (same inputs, outputs,
// template arguments, launch geometry and steps; that file documents them), its SIMD shuffles
// as warp shuffles. Header: mma.cuh. Every thread of a block runs the shuffles (threads past
// CH * L compute the last channel again and write nothing).

constexpr int NS = N / L;
static_assert(N % L == 0 && (L == 1 || L == 2 || L == 4 || L == 8) && NT % 32 == 0,
              "L lanes per channel, adjacent in one warp");
const int T = iparams[0];
const int gid = int(blockIdx.x) * NT + int(threadIdx.x);
const int b = int(blockIdx.y);
const bool owner = gid < CH * L;
const int d = owner ? gid / L : CH - 1;
const int lane = gid % L;
const int n0 = lane * NS;

float a[NS];  // A * log2(e): exp(v) = exp2(v log2(e))
float h[NS];
const int64_t srow = (int64_t(b) * CH + d) * N + n0;
#pragma unroll
for (int k = 0; k < NS; ++k) {
  a[k] = A[d * N + n0 + k] * 1.4426950408889634f;
  h[k] = state_in[srow + k];
}
const float dd = D[d];
const int64_t row0 = int64_t(b) * T;

// token t + 1's inputs, loaded while token t updates the state
float dl_next = 0.0f;
float x_next = 0.0f;
float b_next[NS];
float c_next[NS];
#pragma unroll
for (int k = 0; k < NS; ++k) {
  b_next[k] = 0.0f;
  c_next[k] = 0.0f;
}
int64_t xo = row0 * CH + d;  // the current token's element of x / delta, of B / C
int64_t bo = row0 * N + n0;
if (T > 0) {
  dl_next = delta[xo];
  x_next = bricks::to_float(x[xo]);
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    b_next[k] = Bm[bo + k];
    c_next[k] = Cm[bo + k];
  }
}
for (int t = 0; t < T; ++t) {
  const float dl = dl_next;
  const float xv = x_next;
  float bv[NS];
  float cv[NS];
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    bv[k] = b_next[k];
    cv[k] = c_next[k];
  }
  if (t + 1 < T) {
    xo += CH;  // token t + 1's row of x and delta, and of B and C
    bo += N;
    dl_next = delta[xo];
    x_next = bricks::to_float(x[xo]);
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      b_next[k] = Bm[bo + k];
      c_next[k] = Cm[bo + k];
    }
  }
  const float du = dl * xv;
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    h[k] = exp2f(dl * a[k]) * h[k] + du * bv[k];
    acc += h[k] * cv[k];
  }
#pragma unroll
  for (int m = L / 2; m > 0; m /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, m);
  }
  if (owner && lane == 0) {
    y[(row0 + t) * CH + d] = bricks::from_float<OutT>(acc + dd * xv);
  }
}
if (owner) {
#pragma unroll
  for (int k = 0; k < NS; ++k) {
    state_out[srow + k] = h[k];
  }
}
