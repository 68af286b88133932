// Gated DeltaNet brick: the chunked gated delta rule, one threadgroup per (batch row, value head,
// block of DVB value columns). The delta rule's state columns are independent given q, k, g,
// beta, so a threadgroup owns the (Dk x DVB) slice S of the state (S[d][j] = state[b, hv, j0 + j,
// d]) in threadgroup memory, float32, and walks the chunks of C tokens in order. Per chunk
// (bricks/gated_delta/chunked.py has the derivation; L, e below are per key dim d when VEC):
//   L_t = sum_{s <= t} log g_s (from the chunk's start), e_ti = exp(L_t - L_i) for i <= t
//   A_ti = beta_t sum_d k_td k_id e_tid (i < t),  QK_ti = sum_d q_td k_id e_tid (i <= t)
//   KS_tj = (k_t e^{L_t}) . S[:, j],  QS_tj = (q_t e^{L_t}) . S[:, j]
//   u_tj = beta_t (v_tj - KS_tj) - sum_{i < t} A_ti u_ij   (forward substitution)
//   y_tj = QS_tj + sum_{i <= t} QK_ti u_ij
//   S[d][j] = e^{L_Cd} S[d][j] + sum_t k_td e^{L_Cd - L_td} u_tj
// Tokens past T in the last chunk count as g = 1, beta = 0, k = q = v = 0 (state unchanged,
// no output).
//
// Template: InT (q/k/v/y dtype), DK, DV (head dims), HK, HV (heads), C (tokens per chunk),
// DVB (value columns per threadgroup, 8 or 16), NT (threads per threadgroup: 128, 4
// SIMD-groups), VEC (0: a gate per head, g (B, T, HV), C = 16: the (C x C) products on 8x8
// simdgroup matrices, one tile per SIMD-group; 1: a gate per key dim, g (B, T, HV, DK),
// C = 8: the (C x C) products pair by pair, the decays of each key dim exact); DK a multiple
// of 8. The state's products (steps d and g) run on 8x8 float simdgroup matrices (the MMA
// path); the forward substitution and the outputs are scalar (C x DVB small tiles).
// Inputs (row-contiguous): q, k (B, T, HK, DK) InT; v (B, T, HV, DV) InT; g (B, T, HV) or
//   (B, T, HV, DK) float (in [0, 1]; log g floored at -60); beta (B, T, HV) float;
//   state_in (B, HV, DV, DK) float; iparams int32 [T].
// Outputs: y (B, T, HV, DV) InT; state_out (B, HV, DV, DK) float; every element written.
// Grid: (NT * DV / DVB, HV, B) threads, threadgroup (NT, 1, 1).
// Threadgroup memory (floats; msl.shared_bytes): 2 C (DK + 1) + DK DVB + 4 C DVB + 2 C C + 4 C,
//   VEC: + C (DK + 1) + DK.

const int T = iparams[0];
const int tid = int(thread_position_in_threadgroup.x);
const int jb = int(threadgroup_position_in_grid.x);
const int hv = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int hk = hv / (HV / HK);
const int j0 = jb * DVB;
const int sg = int(simdgroup_index_in_threadgroup);  // NT / 32 = 4 SIMD-groups
static_assert(NT == 128 && C == (VEC ? 8 : 16) && DK % 8 == 0 && DVB % 8 == 0,
              "VEC == 0: one 8x8 tile of the (C x C) products per SIMD-group");

// rows of keys / queries padded by one float: the (t, i) products read C rows at once
constexpr int KP = DK + 1;
threadgroup float Ks[C * KP];
threadgroup float Qs[C * KP];
threadgroup float S[DK * DVB];
threadgroup float Vs[C * DVB];
threadgroup float Us[C * DVB];
threadgroup float A[C * C];
threadgroup float QK[C * C];
threadgroup float KS[C * DVB];
threadgroup float QS[C * DVB];
threadgroup float Lc[C];
threadgroup float Bc[C];
threadgroup float Gc[C];  // exp(L_t): decay from the chunk's start
threadgroup float Dc[C];  // exp(L_C - L_t): decay to the chunk's end
// VEC: L per key dim, then (step c) the keys decayed to the chunk's end, k e^{L_C - L}
threadgroup float Ls[VEC ? C * KP : 1];
threadgroup float Le[VEC ? DK : 1];  // L_C per key dim

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
    Ks[t * KP + d] = inside ? float(k[src]) : 0.0f;
    Qs[t * KP + d] = inside ? float(q[src]) : 0.0f;
  }
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    const bool inside = t0 + t < T;
    Vs[e] = inside ? float(v[((int64_t(b) * T + t0 + t) * HV + hv) * DV + j0 + j]) : 0.0f;
  }
  if (VEC) {
    for (int e = tid; e < C * DK; e += NT) {
      const int t = e / DK;
      const int d = e % DK;
      const int64_t gi = ((int64_t(b) * T + t0 + t) * HV + hv) * DK + d;
      Ls[t * KP + d] = t0 + t < T ? max(log(g[gi]), -60.0f) : 0.0f;
    }
    for (int t = tid; t < C; t += NT) {
      Bc[t] = t0 + t < T ? beta[(int64_t(b) * T + t0 + t) * HV + hv] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
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
      acc += inside ? max(log(g[gi]), -60.0f) : 0.0f;
      Lc[t] = acc;
      Bc[t] = inside ? beta[gi] : 0.0f;
    }
    for (int t = 0; t < C; ++t) {
      Gc[t] = exp(Lc[t]);
      Dc[t] = exp(acc - Lc[t]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (VEC) {
    // b. the (C x C) products pair by pair, each key dim's decay exact
    for (int e = tid; e < C * C; e += NT) {
      const int t = e / C;
      const int i = e % C;
      float kk = 0.0f;
      float qk = 0.0f;
      if (i <= t) {
        for (int d = 0; d < DK; ++d) {
          const float r = exp(Ls[t * KP + d] - Ls[i * KP + d]) * Ks[i * KP + d];
          kk += Ks[t * KP + d] * r;
          qk += Qs[t * KP + d] * r;
        }
      }
      A[e] = i < t ? Bc[t] * kk : 0.0f;
      QK[e] = qk;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // c. queries and keys decayed from the chunk's start (in place), keys decayed to its end
    // (over L)
    for (int e = tid; e < C * DK; e += NT) {
      const int t = e / DK;
      const int d = e % DK;
      const float L = Ls[t * KP + d];
      const float kv = Ks[t * KP + d];
      Ks[t * KP + d] = kv * exp(L);
      Qs[t * KP + d] *= exp(L);
      Ls[t * KP + d] = kv * exp(Le[d] - L);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // b. (a gate per head) the chunk's key / query products on the MMA path (8x8 simdgroup
  // matrices, float32): one (C x C) tile of k.k and q.k per SIMD-group, the decays after d.
  if (!VEC) {
    const int ti = sg / (C / 8);
    const int tj = sg % (C / 8);
    simdgroup_matrix<float, 8, 8> kk = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_matrix<float, 8, 8> qk = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int d0 = 0; d0 < DK; d0 += 8) {
      simdgroup_matrix<float, 8, 8> ka;
      simdgroup_matrix<float, 8, 8> qa;
      simdgroup_matrix<float, 8, 8> kb;
      simdgroup_load(ka, Ks + ti * 8 * KP + d0, KP);
      simdgroup_load(qa, Qs + ti * 8 * KP + d0, KP);
      simdgroup_load(kb, Ks + tj * 8 * KP + d0, KP, ulong2(0, 0), true);
      simdgroup_multiply_accumulate(kk, ka, kb, kk);
      simdgroup_multiply_accumulate(qk, qa, kb, qk);
    }
    simdgroup_store(kk, A + ti * 8 * C + tj * 8, C);
    simdgroup_store(qk, QK + ti * 8 * C + tj * 8, C);
  }
  // d. the state's products with the chunk's keys / queries (VEC: decayed in step c): the
  // (C x DVB) tiles of k.S and q.S
  for (int tile = sg; tile < (C / 8) * (DVB / 8); tile += NT / 32) {
    const int ti = tile / (DVB / 8);
    const int tj = tile % (DVB / 8);
    simdgroup_matrix<float, 8, 8> ks = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_matrix<float, 8, 8> qs = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int d0 = 0; d0 < DK; d0 += 8) {
      simdgroup_matrix<float, 8, 8> ka;
      simdgroup_matrix<float, 8, 8> qa;
      simdgroup_matrix<float, 8, 8> sb;
      simdgroup_load(ka, Ks + ti * 8 * KP + d0, KP);
      simdgroup_load(qa, Qs + ti * 8 * KP + d0, KP);
      simdgroup_load(sb, S + d0 * DVB + tj * 8, DVB);
      simdgroup_multiply_accumulate(ks, ka, sb, ks);
      simdgroup_multiply_accumulate(qs, qa, sb, qs);
    }
    simdgroup_store(ks, KS + ti * 8 * DVB + tj * 8, DVB);
    simdgroup_store(qs, QS + ti * 8 * DVB + tj * 8, DVB);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // the decays and the causal triangle on the (C x C) products (a gate per head)
  for (int e = tid; e < C * C && !VEC; e += NT) {
    const int t = e / C;
    const int i = e % C;
    const float r = i <= t ? exp(Lc[t] - Lc[i]) : 0.0f;
    A[e] = i < t ? Bc[t] * A[e] * r : 0.0f;
    QK[e] = QK[e] * r;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

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
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // f. outputs
  for (int e = tid; e < C * DVB; e += NT) {
    const int t = e / DVB;
    const int j = e % DVB;
    if (t0 + t < T) {
      float o = (VEC ? 1.0f : Gc[t]) * QS[e];
      for (int i = 0; i <= t; ++i) {
        o += QK[t * C + i] * Us[i * DVB + j];
      }
      y[((int64_t(b) * T + t0 + t) * HV + hv) * DV + j0 + j] = InT(o);
    }
  }
  // g. the state to the chunk's end, S = exp(L_C) S + (K * exp(L_C - L))^T U, on the MMA path:
  // the keys decayed in place (no later step of this chunk reads them; VEC: in Ls since step c),
  // the state scaled, then (DK / 8) x (DVB / 8) tiles over the SIMD-groups, each tile owned by
  // one
  for (int e = tid; e < C * DK && !VEC; e += NT) {
    const int t = e / DK;
    const int d = e % DK;
    Ks[t * KP + d] *= Dc[t];
  }
  for (int e = tid; e < DK * DVB; e += NT) {
    S[e] *= VEC ? exp(Le[e / DVB]) : Gc[C - 1];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup const float* Kd = VEC ? Ls : Ks;
  for (int tile = sg; tile < (DK / 8) * (DVB / 8); tile += NT / 32) {
    const int di = tile / (DVB / 8);
    const int tj = tile % (DVB / 8);
    simdgroup_matrix<float, 8, 8> acc;
    simdgroup_load(acc, S + di * 8 * DVB + tj * 8, DVB);
    for (int c0 = 0; c0 < C; c0 += 8) {
      simdgroup_matrix<float, 8, 8> ka;
      simdgroup_matrix<float, 8, 8> ub;
      simdgroup_load(ka, Kd + c0 * KP + di * 8, KP, ulong2(0, 0), true);
      simdgroup_load(ub, Us + c0 * DVB + tj * 8, DVB);
      simdgroup_multiply_accumulate(acc, ka, ub, acc);
    }
    simdgroup_store(acc, S + di * 8 * DVB + tj * 8, DVB);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// the state slice out
for (int e = tid; e < DK * DVB; e += NT) {
  const int d = e / DVB;
  const int j = e % DVB;
  state_out[((int64_t(b) * HV + hv) * DV + j0 + j) * DK + d] = S[e];
}
