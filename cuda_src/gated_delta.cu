// Gated DeltaNet brick: CUDA twin of metal_src/gated_delta.metal (same inputs, outputs,
// template arguments, launch geometry and chunk steps; that file documents them). Header: mma.cuh.
// The products of steps b and e are scalar FMAs here (the MSL runs them on 8x8 simdgroup
// matrices; an mma.sync version is left).
// The threadgroup arrays live in dynamic shared memory (launch's shared_memory, bytes:
// msl.shared_bytes), carved in the order declared below.

const int T = iparams[0];
const int tid = int(threadIdx.x);
const int jb = int(blockIdx.x);
const int hv = int(blockIdx.y);
const int b = int(blockIdx.z);
const int hk = hv / (HV / HK);
const int j0 = jb * DVB;

extern __shared__ __align__(16) unsigned char smem[];
constexpr int KP = DK + 1;  // rows padded by one float: the (t, i) products read C rows at once
float* Ks = reinterpret_cast<float*>(smem);
float* Qs = Ks + C * KP;
float* S = Qs + C * KP;
float* Vs = S + DK * DVB;
float* Us = Vs + C * DVB;
float* A = Us + C * DVB;
float* QK = A + C * C;
float* KS = QK + C * C;
float* QS = KS + C * DVB;
float* Lc = QS + C * DVB;
float* Bc = Lc + C;
float* Gc = Bc + C;
float* Dc = Gc + C;

// the state slice in
for (int e = tid; e < DK * DVB; e += NT) {
  const int d = e / DVB;
  const int j = e % DVB;
  S[e] = state_in[((int64_t(b) * HV + hv) * DV + j0 + j) * DK + d];
}

const int n_chunks = (T + C - 1) / C;
for (int c = 0; c < n_chunks; ++c) {
  const int t0 = c * C;
  // a. the chunk's keys, queries, value columns, gates
  for (int e = tid; e < C * DK; e += NT) {
    const int t = e / DK;
    const int d = e % DK;
    const bool inside = t0 + t < T;
    const int64_t src = ((int64_t(b) * T + t0 + t) * HK + hk) * DK + d;
    Ks[t * KP + d] = inside ? bricks::to_float(k[src]) : 0.0f;
    Qs[t * KP + d] = inside ? bricks::to_float(q[src]) : 0.0f;
  }
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    const bool inside = t0 + t < T;
    Vs[e] = inside ? bricks::to_float(v[((int64_t(b) * T + t0 + t) * HV + hv) * DV + j0 + j]) : 0.0f;
  }
  if (tid == 0) {
    float acc = 0.0f;
    for (int t = 0; t < C; ++t) {
      const bool inside = t0 + t < T;
      const int64_t gi = (int64_t(b) * T + t0 + t) * HV + hv;
      acc += inside ? fmaxf(logf(g[gi]), -60.0f) : 0.0f;
      Lc[t] = acc;
      Bc[t] = inside ? beta[gi] : 0.0f;
    }
    for (int t = 0; t < C; ++t) {
      Gc[t] = expf(Lc[t]);
      Dc[t] = expf(acc - Lc[t]);
    }
  }
  __syncthreads();

  // b. decayed key / query products and the state's products with the chunk's keys / queries
  for (int e = tid; e < C * C; e += NT) {
    const int t = e / C;
    const int i = e % C;
    float kk = 0.0f;
    float qk = 0.0f;
    if (i <= t) {
      for (int d = 0; d < DK; ++d) {
        kk += Ks[t * KP + d] * Ks[i * KP + d];
        qk += Qs[t * KP + d] * Ks[i * KP + d];
      }
    }
    const float r = i <= t ? expf(Lc[t] - Lc[i]) : 0.0f;
    A[e] = i < t ? Bc[t] * kk * r : 0.0f;
    QK[e] = qk * r;
  }
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    float ks = 0.0f;
    float qs = 0.0f;
    for (int d = 0; d < DK; ++d) {
      ks += Ks[t * KP + d] * S[d * DVB + j];
      qs += Qs[t * KP + d] * S[d * DVB + j];
    }
    KS[e] = ks;
    QS[e] = qs;
  }
  __syncthreads();

  // c. the pseudo-values u, one value column per thread, tokens in order
  for (int j = tid; j < DVB; j += NT) {
    for (int t = 0; t < C; ++t) {
      float u = Bc[t] * (Vs[t * DVB + j] - Gc[t] * KS[t * DVB + j]);
      for (int i = 0; i < t; ++i) {
        u -= A[t * C + i] * Us[i * DVB + j];
      }
      Us[t * DVB + j] = u;
    }
  }
  __syncthreads();

  // d. outputs
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    if (t0 + t < T) {
      float o = Gc[t] * QS[e];
      for (int i = 0; i <= t; ++i) {
        o += QK[t * C + i] * Us[i * DVB + j];
      }
      y[((int64_t(b) * T + t0 + t) * HV + hv) * DV + j0 + j] = bricks::from_float<InT>(o);
    }
  }
  // e. the state to the chunk's end
  const float decay_end = Gc[C - 1];
  for (int e = tid; e < DK * DVB; e += NT) {
    const int d = e / DVB;
    const int j = e % DVB;
    float s = decay_end * S[e];
    for (int t = 0; t < C; ++t) {
      s += Ks[t * KP + d] * Dc[t] * Us[t * DVB + j];
    }
    S[e] = s;
  }
  __syncthreads();
}

// the state slice out
for (int e = tid; e < DK * DVB; e += NT) {
  const int d = e / DVB;
  const int j = e % DVB;
  state_out[((int64_t(b) * HV + hv) * DV + j0 + j) * DK + d] = S[e];
}
