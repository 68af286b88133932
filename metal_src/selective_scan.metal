// Selective-scan brick: Mamba-1's selective state space over a prefill (bricks/selective_scan/
// op.py). L threads share a channel d: lane l keeps the state entries n = l * (N / L) + k,
// k < N / L, of h[d][n] in registers (float32) and walks the tokens in order. Per token t:
//   h[d][n] = exp(delta_t[d] A[d][n]) h[d][n] + delta_t[d] x_t[d] B_t[n]
//   y_t[d]  = sum_n h[d][n] C_t[n] + D[d] x_t[d]   (the L lanes' partial sums by SIMD shuffles)
// Channels and state entries are independent: no threadgroup memory, no barrier. The next
// token's inputs are loaded before the current token's update (the loop's one dependency is h);
// the k loops are unrolled (the per-thread arrays stay in registers).
//
// Template: InT (x), OutT (y), CH (channels), N (state entries per channel), L (lanes per
// channel: 1, 2, 4 or 8, dividing N), NT (threads per threadgroup, a multiple of 32: a channel's
// lanes are adjacent lanes of one SIMD-group).
// Inputs (row-contiguous): x (B, T, CH) InT; delta (B, T, CH) float (softplus done); A (CH, N)
//   float (-exp(A_log)); Bm, Cm (B, T, N) float; D (CH) float; state_in (B, CH, N) float;
//   iparams int32 [T].
// Outputs: y (B, T, CH) OutT; state_out (B, CH, N) float; every element written.
// Grid: (ceil(CH * L / NT) * NT, B, 1) threads, threadgroup (NT, 1, 1). Threads past CH * L
// compute the last channel again (every lane stays in the shuffles) and write nothing.

constexpr int NS = N / L;
static_assert(N % L == 0 && (L == 1 || L == 2 || L == 4 || L == 8) && NT % 32 == 0,
              "L lanes per channel, adjacent in one SIMD-group");
const int T = iparams[0];
const int gid = int(threadgroup_position_in_grid.x) * NT + int(thread_position_in_threadgroup.x);
const int b = int(threadgroup_position_in_grid.y);
const bool owner = gid < CH * L;
const int d = owner ? gid / L : CH - 1;
const int lane = gid % L;
const int n0 = lane * NS;

float a[NS];  // A * log2(e): exp(v) = exp2(v log2(e))
float h[NS];
const int64_t srow = (int64_t(b) * CH + d) * N + n0;
#pragma clang loop unroll(full)
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
#pragma clang loop unroll(full)
for (int k = 0; k < NS; ++k) {
  b_next[k] = 0.0f;
  c_next[k] = 0.0f;
}
int64_t xo = row0 * CH + d;  // the current token's element of x / delta, of B / C
int64_t bo = row0 * N + n0;
if (T > 0) {
  dl_next = delta[xo];
  x_next = float(x[xo]);
  #pragma clang loop unroll(full)
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
  #pragma clang loop unroll(full)
for (int k = 0; k < NS; ++k) {
    bv[k] = b_next[k];
    cv[k] = c_next[k];
  }
  if (t + 1 < T) {
    xo += CH;  // token t + 1's row of x and delta, and of B and C
    bo += N;
    dl_next = delta[xo];
    x_next = float(x[xo]);
    #pragma clang loop unroll(full)
for (int k = 0; k < NS; ++k) {
      b_next[k] = Bm[bo + k];
      c_next[k] = Cm[bo + k];
    }
  }
  const float du = dl * xv;
  float acc = 0.0f;
  #pragma clang loop unroll(full)
for (int k = 0; k < NS; ++k) {
    h[k] = exp2(dl * a[k]) * h[k] + du * bv[k];
    acc += h[k] * cv[k];
  }
  for (ushort m = L / 2; m > 0; m /= 2) {
    acc += simd_shuffle_xor(acc, m);
  }
  if (owner && lane == 0) {
    y[(row0 + t) * CH + d] = OutT(acc + dd * xv);
  }
}
if (owner) {
  #pragma clang loop unroll(full)
for (int k = 0; k < NS; ++k) {
    state_out[srow + k] = h[k];
  }
}
