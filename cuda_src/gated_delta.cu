// Gated DeltaNet brick: CUDA twin of metal_src/gated_delta.metal (same inputs, outputs,
// template arguments, launch geometry and chunk steps, VEC included; that file documents them).
// Header: mma.cuh. The state's and (VEC == 0) the chunk's products are scalar FMAs here (the MSL
// runs them on 8x8 simdgroup matrices; an mma.sync version is left).
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
float* Ls = Dc + C;           // VEC: L per key dim, then the keys decayed to the chunk's end
float* Le = Ls + C * KP;      // VEC: L_C per key dim

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
  if (VEC) {
    for (int e = tid; e < C * DK; e += NT) {
      const int t = e / DK;
      const int d = e % DK;
      const int64_t gi = ((int64_t(b) * T + t0 + t) * HV + hv) * DK + d;
      Ls[t * KP + d] = t0 + t < T ? fmaxf(logf(g[gi]), -60.0f) : 0.0f;
    }
    for (int t = tid; t < C; t += NT) {
      Bc[t] = t0 + t < T ? beta[(int64_t(b) * T + t0 + t) * HV + hv] : 0.0f;
    }
    __syncthreads();
    for (int d = tid; d < DK; d += NT) {
      float acc = 0.0f;
      for (int t = 0; t < C; ++t) {
        acc += Ls[t * KP + d];
        Ls[t * KP + d] = acc;
      }
      Le[d] = acc;
    }
  } else if (tid == 0) {
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

  // b. decayed key / query products (VEC: each key dim's decay exact, pair by pair)
  for (int e = tid; e < C * C; e += NT) {
    const int t = e / C;
    const int i = e % C;
    float kk = 0.0f;
    float qk = 0.0f;
    if (i <= t) {
      for (int d = 0; d < DK; ++d) {
        const float r = VEC ? expf(Ls[t * KP + d] - Ls[i * KP + d]) * Ks[i * KP + d]
                            : Ks[i * KP + d];
        kk += Ks[t * KP + d] * r;
        qk += Qs[t * KP + d] * r;
      }
    }
    const float r = VEC ? 1.0f : (i <= t ? expf(Lc[t] - Lc[i]) : 0.0f);
    A[e] = i < t ? Bc[t] * kk * r : 0.0f;
    QK[e] = qk * r;
  }
  if (VEC) {
    // c. queries and keys decayed from the chunk's start (in place), keys decayed to its end
    // (over L)
    __syncthreads();
    for (int e = tid; e < C * DK; e += NT) {
      const int t = e / DK;
      const int d = e % DK;
      const float L = Ls[t * KP + d];
      const float kv = Ks[t * KP + d];
      Ks[t * KP + d] = kv * expf(L);
      Qs[t * KP + d] *= expf(L);
      Ls[t * KP + d] = kv * expf(Le[d] - L);
    }
    __syncthreads();
  }
  // d. the state's products with the chunk's (VEC: decayed) keys / queries
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

  // e. the pseudo-values u, one value column per thread, tokens in order
  for (int j = tid; j < DVB; j += NT) {
    for (int t = 0; t < C; ++t) {
      float u = Bc[t] * (Vs[t * DVB + j] - (VEC ? 1.0f : Gc[t]) * KS[t * DVB + j]);
      for (int i = 0; i < t; ++i) {
        u -= A[t * C + i] * Us[i * DVB + j];
      }
      Us[t * DVB + j] = u;
    }
  }
  __syncthreads();

  // f. outputs
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    if (t0 + t < T) {
      float o = (VEC ? 1.0f : Gc[t]) * QS[e];
      for (int i = 0; i <= t; ++i) {
        o += QK[t * C + i] * Us[i * DVB + j];
      }
      y[((int64_t(b) * T + t0 + t) * HV + hv) * DV + j0 + j] = bricks::from_float<InT>(o);
    }
  }
  // g. the state to the chunk's end (VEC: the keys decayed to it in Ls since step c)
  for (int e = tid; e < DK * DVB; e += NT) {
    const int d = e / DVB;
    const int j = e % DVB;
    float s = (VEC ? expf(Le[d]) : Gc[C - 1]) * S[e];
    for (int t = 0; t < C; ++t) {
      s += (VEC ? Ls[t * KP + d] : Ks[t * KP + d] * Dc[t]) * Us[t * DVB + j];
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
