// SSD brick: CUDA twin of metal_src/ssd.metal (same inputs, outputs, template arguments,
// launch geometry and chunk steps; that file documents them). Header: mma.cuh.
// The products of steps b, c and e are scalar FMAs here (the MSL runs them on 8x8 simdgroup
// matrices; an mma.sync version is left).
// The threadgroup arrays live in dynamic shared memory (launch's shared_memory, bytes:
// msl.shared_bytes), carved in the order declared below.

const int T = iparams[0];
const int tid = int(threadIdx.x);
const int jb = int(blockIdx.x);
const int h = int(blockIdx.y);
const int b = int(blockIdx.z);
const int g = h / (H / G);
const int p0 = jb * PB;

extern __shared__ __align__(16) unsigned char smem[];
constexpr int NP = N + 1;  // rows padded by one float: the (t, i) products read C rows at once
float* Bs = reinterpret_cast<float*>(smem);
float* Cs = Bs + C * NP;
float* S = Cs + C * NP;
float* Xs = S + N * PB;
float* Ys = Xs + C * PB;
float* M = Ys + C * PB;
float* Lc = M + C * C;
float* Gc = Lc + C;
float* Dc = Gc + C;

const float a_h = A[h];
const float d_h = D[h];

// the state slice in
for (int e = tid; e < N * PB; e += NT) {
  const int n = e / PB;
  const int j = e % PB;
  S[e] = state_in[((int64_t(b) * H + h) * P + p0 + j) * N + n];
}

const int n_chunks = (T + C - 1) / C;
for (int c = 0; c < n_chunks; ++c) {
  const int t0 = c * C;
  // a. the chunk's B and C rows, its time-step-scaled inputs, its decays
  for (int e = tid; e < C * N; e += NT) {
    const int t = e / N;
    const int n = e % N;
    const bool inside = t0 + t < T;
    const int64_t src = ((int64_t(b) * T + t0 + t) * G + g) * N + n;
    Bs[t * NP + n] = inside ? bricks::to_float(Bm[src]) : 0.0f;
    Cs[t * NP + n] = inside ? bricks::to_float(Cm[src]) : 0.0f;
  }
  for (int e = tid; e < C * PB; e += NT) {
    const int t = e / PB;
    const int j = e % PB;
    const bool inside = t0 + t < T;
    const int64_t row = (int64_t(b) * T + t0 + t) * H + h;
    Xs[e] = inside ? dt[row] * bricks::to_float(x[row * P + p0 + j]) : 0.0f;
  }
  if (tid == 0) {
    float acc = 0.0f;
    for (int t = 0; t < C; ++t) {
      const bool inside = t0 + t < T;
      acc += inside ? dt[(int64_t(b) * T + t0 + t) * H + h] * a_h : 0.0f;
      Lc[t] = acc;
    }
    for (int t = 0; t < C; ++t) {
      Gc[t] = expf(Lc[t]);
      Dc[t] = expf(acc - Lc[t]);
    }
  }
  __syncthreads();

  // b. the decayed C.B product (causal triangle) and the state's part of y
  for (int e = tid; e < C * C; e += NT) {
    const int t = e / C;
    const int i = e % C;
    float cb = 0.0f;
    if (i <= t) {
      for (int n = 0; n < N; ++n) {
        cb += Cs[t * NP + n] * Bs[i * NP + n];
      }
    }
    M[e] = i <= t ? cb * expf(Lc[t] - Lc[i]) : 0.0f;
  }
  for (int e = tid; e < C * PB; e += NT) {
    const int t = e / PB;
    const int j = e % PB;
    float cs = 0.0f;
    for (int n = 0; n < N; ++n) {
      cs += Cs[t * NP + n] * S[n * PB + j];
    }
    Ys[e] = Gc[t] * cs;
  }
  __syncthreads();

  // c, d. y = M X + (the state's part) + D x
  for (int e = tid; e < C * PB; e += NT) {
    const int t = e / PB;
    const int j = e % PB;
    if (t0 + t < T) {
      float o = Ys[e];
      for (int i = 0; i <= t; ++i) {
        o += M[t * C + i] * Xs[i * PB + j];
      }
      const int64_t dst = ((int64_t(b) * T + t0 + t) * H + h) * P + p0 + j;
      y[dst] = bricks::from_float<OutT>(o + d_h * bricks::to_float(x[dst]));
    }
  }
  // e. the state to the chunk's end
  const float decay_end = Gc[C - 1];
  for (int e = tid; e < N * PB; e += NT) {
    const int n = e / PB;
    const int j = e % PB;
    float s = decay_end * S[e];
    for (int t = 0; t < C; ++t) {
      s += Bs[t * NP + n] * Dc[t] * Xs[t * PB + j];
    }
    S[e] = s;
  }
  __syncthreads();
}

// the state slice out
for (int e = tid; e < N * PB; e += NT) {
  const int n = e / PB;
  const int j = e % PB;
  state_out[((int64_t(b) * H + h) * P + p0 + j) * N + n] = S[e];
}
