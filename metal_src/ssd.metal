// SSD brick: Mamba-2's selective state space in chunks (state space duality), one threadgroup
// per (batch row, head, block of PB head columns). Given the time steps, the head's state
// columns are independent, so a threadgroup owns the (N x PB) slice S of the state
// (S[n][j] = state[b, h, p0 + j, n]) in threadgroup memory, float32, and walks the chunks of C
// tokens in order. Per chunk (bricks/ssd/op.py has the derivation), with a_t = dt_t A:
//   L_t = sum_{s <= t} a_s (from the chunk's start),  X_tj = dt_t x_tj
//   M_ti = (C_t . B_i) exp(L_t - L_i) for i <= t, 0 above
//   y_tj = sum_{i <= t} M_ti X_ij + exp(L_t) (C_t . S[:, j]) + D x_tj
//   S[n][j] = exp(L_C) S[n][j] + sum_t B_tn exp(L_C - L_t) X_tj
// Tokens past T in the last chunk count as dt = 0, B = C = 0 (state unchanged, no output).
//
// Template: InT (x/B/C dtype), OutT (y dtype: x's and D's common dtype), P, N (head dim and
// state size), H, G (heads and groups; head h reads group h / (H / G)), C (tokens per chunk),
// PB (head columns per threadgroup, 8 or 16), NT (threads per threadgroup: 128, 4 SIMD-groups,
// one 8x8 tile each of the (C x C) product at C = 16); N a multiple of 8.
// The products C.B, C.S, M X and the state update run on 8x8 float simdgroup matrices.
// Inputs (row-contiguous): x (B, T, H, P) InT; dt (B, T, H) float (softplus, bias and clip
//   done; 0 at masked tokens); A (H) float (-exp(A_log)); Bm, Cm (B, T, G, N) InT; D (H) float;
//   state_in (B, H, P, N) float; iparams int32 [T].
// Outputs: y (B, T, H, P) OutT; state_out (B, H, P, N) float; every element written.
// Grid: (NT * P / PB, H, B) threads, threadgroup (NT, 1, 1).
// Threadgroup memory: (2 C (N + 1) + N PB + 2 C PB + C C + 3 C) floats (msl.shared_bytes).

const int T = iparams[0];
const int tid = int(thread_position_in_threadgroup.x);
const int jb = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int g = h / (H / G);
const int p0 = jb * PB;
const int sg = int(simdgroup_index_in_threadgroup);  // NT / 32 = 4 SIMD-groups
static_assert(NT == 128 && C == 16 && N % 8 == 0 && PB % 8 == 0,
              "one 8x8 tile of the (C x C) product per SIMD-group");

// rows of B and C padded by one float: the (t, i) products read C rows at once
constexpr int NP = N + 1;
threadgroup float Bs[C * NP];
threadgroup float Cs[C * NP];
threadgroup float S[N * PB];
threadgroup float Xs[C * PB];
threadgroup float Ys[C * PB];
threadgroup float M[C * C];
threadgroup float Lc[C];
threadgroup float Gc[C];  // exp(L_t): decay from the chunk's start
threadgroup float Dc[C];  // exp(L_C - L_t): decay to the chunk's end

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
    Bs[t * NP + n] = inside ? float(Bm[src]) : 0.0f;
    Cs[t * NP + n] = inside ? float(Cm[src]) : 0.0f;
  }
  for (int e = tid; e < C * PB; e += NT) {
    const int t = e / PB;
    const int j = e % PB;
    const bool inside = t0 + t < T;
    const int64_t row = (int64_t(b) * T + t0 + t) * H + h;
    Xs[e] = inside ? dt[row] * float(x[row * P + p0 + j]) : 0.0f;
  }
  if (tid == 0) {
    float acc = 0.0f;
    for (int t = 0; t < C; ++t) {
      const bool inside = t0 + t < T;
      acc += inside ? dt[(int64_t(b) * T + t0 + t) * H + h] * a_h : 0.0f;
      Lc[t] = acc;
    }
    for (int t = 0; t < C; ++t) {
      Gc[t] = exp(Lc[t]);
      Dc[t] = exp(acc - Lc[t]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // b. C.B (one 8x8 tile of the (C x C) product per SIMD-group) and C.S (the (C x PB) tiles)
  // on the MMA path
  {
    const int ti = sg / (C / 8);
    const int tj = sg % (C / 8);
    simdgroup_matrix<float, 8, 8> cb = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int n0 = 0; n0 < N; n0 += 8) {
      simdgroup_matrix<float, 8, 8> ca;
      simdgroup_matrix<float, 8, 8> bb;
      simdgroup_load(ca, Cs + ti * 8 * NP + n0, NP);
      simdgroup_load(bb, Bs + tj * 8 * NP + n0, NP, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(cb, ca, bb, cb);
    }
    simdgroup_store(cb, M + ti * 8 * C + tj * 8, C);
  }
  for (int tile = sg; tile < (C / 8) * (PB / 8); tile += NT / 32) {
    const int ti = tile / (PB / 8);
    const int tj = tile % (PB / 8);
    simdgroup_matrix<float, 8, 8> cs = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int n0 = 0; n0 < N; n0 += 8) {
      simdgroup_matrix<float, 8, 8> ca;
      simdgroup_matrix<float, 8, 8> sb;
      simdgroup_load(ca, Cs + ti * 8 * NP + n0, NP);
      simdgroup_load(sb, S + n0 * PB + tj * 8, PB);
      simdgroup_multiply_accumulate(cs, ca, sb, cs);
    }
    simdgroup_store(cs, Ys + ti * 8 * PB + tj * 8, PB);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // the decays and the causal triangle on C.B; the state's part of y decayed from the start
  for (int e = tid; e < C * C; e += NT) {
    const int t = e / C;
    const int i = e % C;
    M[e] = i <= t ? M[e] * exp(Lc[t] - Lc[i]) : 0.0f;
  }
  for (int e = tid; e < C * PB; e += NT) {
    Ys[e] *= Gc[e / PB];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // c. y = M X + (the state's part), one (C x PB) tile per SIMD-group on the MMA path
  for (int tile = sg; tile < (C / 8) * (PB / 8); tile += NT / 32) {
    const int ti = tile / (PB / 8);
    const int tj = tile % (PB / 8);
    simdgroup_matrix<float, 8, 8> acc;
    simdgroup_load(acc, Ys + ti * 8 * PB + tj * 8, PB);
    for (int i0 = 0; i0 < C; i0 += 8) {
      simdgroup_matrix<float, 8, 8> ma;
      simdgroup_matrix<float, 8, 8> xb;
      simdgroup_load(ma, M + ti * 8 * C + i0, C);
      simdgroup_load(xb, Xs + i0 * PB + tj * 8, PB);
      simdgroup_multiply_accumulate(acc, ma, xb, acc);
    }
    simdgroup_store(acc, Ys + ti * 8 * PB + tj * 8, PB);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // d. outputs with the skip D x (x read again: it is in cache)
  for (int e = tid; e < C * PB; e += NT) {
    const int t = e / PB;
    const int j = e % PB;
    if (t0 + t < T) {
      const int64_t dst = ((int64_t(b) * T + t0 + t) * H + h) * P + p0 + j;
      y[dst] = OutT(Ys[e] + d_h * float(x[dst]));
    }
  }
  // e. the state to the chunk's end, S = exp(L_C) S + B^T (X * exp(L_C - L)), on the MMA
  // path: the inputs decayed in place (no later step of this chunk reads them), the state
  // scaled, then (N / 8) x (PB / 8) tiles over the SIMD-groups, each tile owned by one
  const float decay_end = Gc[C - 1];
  for (int e = tid; e < C * PB; e += NT) {
    Xs[e] *= Dc[e / PB];
  }
  for (int e = tid; e < N * PB; e += NT) {
    S[e] *= decay_end;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int tile = sg; tile < (N / 8) * (PB / 8); tile += NT / 32) {
    const int ni = tile / (PB / 8);
    const int tj = tile % (PB / 8);
    simdgroup_matrix<float, 8, 8> acc;
    simdgroup_load(acc, S + ni * 8 * PB + tj * 8, PB);
    for (int c0 = 0; c0 < C; c0 += 8) {
      simdgroup_matrix<float, 8, 8> ba;
      simdgroup_matrix<float, 8, 8> xb;
      simdgroup_load(ba, Bs + c0 * NP + ni * 8, NP, ulong2(0, 0), true);
      simdgroup_load(xb, Xs + c0 * PB + tj * 8, PB);
      simdgroup_multiply_accumulate(acc, ba, xb, acc);
    }
    simdgroup_store(acc, S + ni * 8 * PB + tj * 8, PB);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// the state slice out
for (int e = tid; e < N * PB; e += NT) {
  const int n = e / PB;
  const int j = e % PB;
  state_out[((int64_t(b) * H + h) * P + p0 + j) * N + n] = S[e];
}
